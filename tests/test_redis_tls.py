"""rediss://: the Redis store over TLS, against a real redis-server (Debian's is built with TLS)
serving a certificate the test makes. The store verifies the server with the CA file the URL
names (`?ca=`), and one it cannot verify fails open like any broken store."""

import datetime
import ipaddress

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from redisserver import _free_port, start_redis

from cg.store import RedisStore, StoreError


def _self_signed(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that is its own CA, and its key: (certificate file, key file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cg test redis")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "redis.crt", directory / "redis.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture
def tls_redis(tmp_path_factory):
    """(the server, its TLS port, the CA file that verifies it); its plain port is the admin's."""
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    port = _free_port()
    server = start_redis(tmp_path_factory, "--tls-port", str(port), "--tls-cert-file", cert,
                         "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no")
    yield server, port, cert
    server.kill()


@pytest_twisted.ensureDeferred
async def test_a_store_over_tls_verifies_the_server_with_the_ca_it_is_given(tls_redis, closing):  # noqa: F811
    server, port, ca = tls_redis
    store = RedisStore(f"rediss://127.0.0.1:{port}/0?ca={ca}")
    closing(store)
    assert await store.put("t", {"0123456789abcdef": b"over TLS"}) == {"0123456789abcdef"}
    assert await store.get("t", "0123456789abcdef") == b"over TLS"
    assert await store.freeze("t", "toolu_1", b"repair") == b"repair"
    assert server.admin.get("cg:t:t:o:0123456789abcdef") == b"over TLS"  # this server, read in plain
    assert store.stats.healthy

    unverified = RedisStore(f"rediss://127.0.0.1:{port}/0")  # the system's CAs do not know this one
    closing(unverified)
    with pytest.raises(StoreError, match="(?i)certificate verify failed"):
        await unverified.put("t", {"fedcba9876543210": b"not sent"})
    assert not unverified.stats.healthy
    assert server.admin.get("cg:t:t:o:fedcba9876543210") is None
