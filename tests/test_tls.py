"""HTTPS upstreams: certificates are verified; --upstream-ca trusts a private CA."""

import datetime
import ipaddress

import anthropic
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pytest_twisted import blockon, inlineCallbacks
from twisted.internet import reactor, ssl
from twisted.internet.threads import deferToThread

from cg.testing import FakeUpstream

REQUEST = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _name(common_name):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject, issuer, public_key, signing_key, *, ca: bool, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory):
    """A CA and a server certificate for localhost/127.0.0.1 signed by it."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(_name("cg test CA"), _name("cg test CA"), ca_key.public_key(), ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = _certificate(_name("localhost"), ca.subject, key.public_key(), ca_key, ca=False, sans=sans)
    pem = serialization.Encoding.PEM
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(pem))
    server = ssl.PrivateCertificate.loadPEM(
        cert.public_bytes(pem)
        + key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(ca_file), server.options()


@pytest.fixture
def https_fake(private_ca):
    upstream = FakeUpstream()
    upstream.listen(reactor, tls=private_ca[1])
    yield upstream
    blockon(upstream.stop())


@inlineCallbacks
def test_private_ca_is_trusted_with_upstream_ca(make_cg, https_fake, private_ca):
    url = https_fake.url.replace("127.0.0.1", "localhost")
    cg = make_cg(anthropic_upstream=url, upstream_ca=private_ca[0])
    client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0)
    message = yield deferToThread(client.messages.create, **REQUEST)
    assert message.content[0].text
    assert len(https_fake.received) == 1


@inlineCallbacks
def test_unknown_ca_is_refused_with_502(make_cg, https_fake):
    cg = make_cg(anthropic_upstream=https_fake.url)
    client = anthropic.Anthropic(base_url=cg.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as caught:
        yield deferToThread(client.messages.create, **REQUEST)
    assert caught.value.status_code == 502
    assert https_fake.received == []
