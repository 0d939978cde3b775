"""Kafka client security (TLS and SASL) for every kvstream Kafka reader and writer.

One place parses, validates and applies the security settings of the Kafka sink, the Kafka
index source and every command built on them (``demo``, ``bridge``, ``index``, ``shard``,
``replay``). Settings come from three places, highest precedence first:

1. the URL's query: ``kafka://host:9093/topic?security_protocol=SASL_SSL&sasl_mechanism=...``;
2. environment variables ``KVSTREAM_KAFKA_<OPTION>`` (``KVSTREAM_KAFKA_SASL_PASSWORD``...);
3. a config file named by ``kafka_config=PATH`` (URL) or ``KVSTREAM_KAFKA_CONFIG``:
   ``key=value`` lines (``#`` comments) with the option names below; dots count as
   underscores and librdkafka's names are understood (``security.protocol``,
   ``sasl.mechanism``, ``sasl.username``, ``sasl.password``, ``ssl.ca.location``,
   ``ssl.certificate.location``, ``ssl.key.location``, ``ssl.key.password``).

Options (:data:`OPTIONS`):

- ``security_protocol``: PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL.
- ``ssl_cafile`` (the CA bundle to trust; default: the system's), ``ssl_certfile`` and
  ``ssl_keyfile`` (a client certificate, for brokers that authenticate clients by TLS),
  ``ssl_password`` (the key's password), ``ssl_check_hostname`` (default true).
- ``sasl_mechanism``: PLAIN (default), SCRAM-SHA-256 or SCRAM-SHA-512; ``sasl_username``
  and ``sasl_password`` (``sasl_plain_username``/``sasl_plain_password`` are accepted too).
- Every password (``sasl_password``, ``ssl_password``) can instead be read from a file
  (``sasl_password_file=PATH``) or an environment variable named in the URL
  (``sasl_password_env=NAME``): a password in a URL ends up in shell histories and process
  lists.

Contract: settings that cannot work are refused up front with a :class:`ConfigError` naming
the option (an unknown protocol or mechanism, SASL or TLS options with a protocol that does
not use them, a missing username or password, an unreadable file, a key that does not load).
Secrets never leave this module in text: :class:`Secret` prints as ``***``, so do
:class:`KafkaSecurity`'s repr and :meth:`KafkaSecurity.describe`, and :func:`redact_url`
masks them in URLs that are echoed (error messages, ``--json`` outputs, summaries).
:meth:`KafkaSecurity.client_kwargs` is the only way to the clear text: the keyword arguments of
aiokafka's producer, consumer and admin clients.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvstream.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "OPTIONS",
    "KafkaSecurity",
    "Secret",
    "describe_error",
    "is_security_option",
    "redact_url",
    "security_options",
]

ENV_PREFIX: Final = "KVSTREAM_KAFKA_"
PROTOCOLS: Final = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SECRETS: Final = ("sasl_password", "ssl_password")
_ALIASES: Final = {
    "sasl_plain_username": "sasl_username",
    "sasl_plain_password": "sasl_password",
    "sasl_plain_password_env": "sasl_password_env",
    "sasl_plain_password_file": "sasl_password_file",
    # librdkafka's names (after dots became underscores)
    "ssl_ca_location": "ssl_cafile",
    "ssl_certificate_location": "ssl_certfile",
    "ssl_key_location": "ssl_keyfile",
    "ssl_key_password": "ssl_password",
}
_CANONICAL: Final = (
    "security_protocol",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_password_env",
    "ssl_password_file",
    "ssl_check_hostname",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "sasl_password_env",
    "sasl_password_file",
)
#: Every query key this module owns (a URL parser passes these here and refuses the rest).
OPTIONS: Final = (*_CANONICAL, *_ALIASES, "kafka_config")
_MASK: Final = "***"
#: Query keys whose values are masked in echoed URLs.
_SECRET_KEYS: Final = frozenset(
    k for k in (*_CANONICAL, *_ALIASES) if _ALIASES.get(k, k) in _SECRETS
)


class Secret:
    """A password: prints as ``***`` (str, repr, format); :meth:`reveal` gives the text."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The clear text, for the Kafka client only."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return _MASK

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def describe_error(exc: BaseException) -> str:
    """``Name: message`` with the exception's name once (aiokafka's errors already start
    their text with it: ``KafkaConnectionError: Unable to bootstrap...``)."""
    name, text = type(exc).__name__, str(exc)
    if not text or text == name:
        return name
    return text if text.startswith(f"{name}:") else f"{name}: {text}"


def is_security_option(key: str) -> bool:
    """True when ``key`` is a query key of this module (see :data:`OPTIONS`)."""
    return key in OPTIONS


def security_options(params: Mapping[str, str]) -> dict[str, str]:
    """The security options among a URL's query ``params``."""
    return {k: v for k, v in params.items() if k in OPTIONS}


_SECRET_ALTS = "|".join(sorted(_SECRET_KEYS))
_URL_SECRET = re.compile(rf"([?&](?:{_SECRET_ALTS})=)([^&#]*)")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^/@?#:]*:)([^/@?#]*)@")


def redact_url(url: str) -> str:
    """``url`` with every secret's value replaced by ``***`` (query passwords, and the
    password of a ``scheme://user:password@host`` form): safe to print or log."""
    text = _URL_SECRET.sub(lambda m: m.group(1) + _MASK, url)
    return _USERINFO.sub(lambda m: m.group(1) + _MASK + "@", text)


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """Validated security settings of one Kafka client; build one with :meth:`from_options`.

    The default instance is PLAINTEXT (no TLS, no SASL). ``ssl_context`` is built (and every
    file read) when the settings are parsed, so a bad certificate is a ConfigError then, not
    a connection failure later. The repr shows no secret.
    """

    security_protocol: str = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: Secret | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    @property
    def uses_ssl(self) -> bool:
        """True for SSL and SASL_SSL."""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        """True for SASL_PLAINTEXT and SASL_SSL."""
        return self.security_protocol.startswith("SASL_")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's ``AIOKafkaProducer``/``AIOKafkaConsumer``/
        ``AIOKafkaAdminClient``: ``security_protocol``, and ``ssl_context`` and the SASL
        settings where the protocol uses them."""
        out: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_ssl:
            out["ssl_context"] = self.ssl_context
        if self.uses_sasl:
            out["sasl_mechanism"] = self.sasl_mechanism
            out["sasl_plain_username"] = self.sasl_username
            out["sasl_plain_password"] = (
                self.sasl_password.reveal() if self.sasl_password is not None else None
            )
        return out

    def explain(self, exc: BaseException) -> str:
        """A client's failure to connect, for people: :func:`describe_error`, and for a
        failed SASL login what happened (aiokafka's SCRAM client raises a bare
        ``KeyError: 'v'`` when the broker answers the exchange with an error, e.g. an
        unknown user or a wrong password)."""
        text = describe_error(exc)
        if self.uses_sasl and isinstance(exc, KeyError):
            return (
                f"SASL {self.sasl_mechanism} login as {self.sasl_username!r} refused by the "
                f"broker (unknown user or wrong password; aiokafka: {text})"
            )
        return text

    def describe(self) -> dict[str, Any]:
        """The settings for people and ``--json`` outputs: no secret, only whether it is set."""
        out: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_ssl:
            out.update(
                ssl_cafile=self.ssl_cafile,
                ssl_certfile=self.ssl_certfile,
                ssl_keyfile=self.ssl_keyfile,
                ssl_check_hostname=self.ssl_check_hostname,
            )
        if self.uses_sasl:
            out.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_username=self.sasl_username,
                sasl_password="***" if self.sasl_password is not None else None,
            )
        return out

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        where: str = "the Kafka settings",
    ) -> KafkaSecurity:
        """Parse and validate settings: ``options`` (a URL's query; other keys are ignored)
        over ``KVSTREAM_KAFKA_*`` in ``environ`` (default ``os.environ``) over the config
        file (``kafka_config`` or ``KVSTREAM_KAFKA_CONFIG``). ``where`` names the origin in
        error messages (pass a :func:`redact_url`-ed URL). Raises :class:`ConfigError`."""
        env = os.environ if environ is None else environ
        given = _canonical(security_options(options or {}), where)
        from_env = _canonical(_env_options(env), "the KVSTREAM_KAFKA_* environment")
        config = (options or {}).get("kafka_config") or env.get(ENV_PREFIX + "CONFIG")
        from_file = _canonical(_read_config(config), f"Kafka config {config}") if config else {}
        merged = {**from_file, **from_env, **given}
        protocol = merged.get("security_protocol", "PLAINTEXT").strip().upper()
        # an inherited (environment, file) option the protocol does not use is ignored: a
        # shell set up for a secured cluster can still reach a PLAINTEXT one by URL
        unused = tuple(
            prefix
            for prefix, used in (
                ("ssl_", protocol in ("SSL", "SASL_SSL")),
                ("sasl_", protocol.startswith("SASL_")),
            )
            if not used
        )
        for key in list(merged):
            if unused and key not in given and key.startswith(unused):
                del merged[key]
        return _build(merged, where, env)


def _canonical(options: Mapping[str, str], where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in options.items():
        name = _ALIASES.get(key, key)
        if name == "kafka_config":
            continue
        if name in out and out[name] != value:
            raise ConfigError(f"{where}: {key} repeats {name} with another value")
        out[name] = value
    return out


def _env_options(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name in (*_CANONICAL, *_ALIASES):
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None:
            out[name] = value
    return out


def _read_config(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the Kafka config file {path}: {exc}") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        key = key.strip().replace(".", "_").lower()
        if not sep or not key:
            raise ConfigError(f"Kafka config {path}, line {n}: expected key=value")
        if key not in OPTIONS or key == "kafka_config":
            known = ", ".join(_CANONICAL)
            raise ConfigError(
                f"Kafka config {path}, line {n}: unknown option {key!r}; known: {known}"
            )
        out[key] = value.strip()
    return out


def _bool(value: str, key: str, where: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on", ""):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")


def _secret(
    opts: Mapping[str, str], name: str, where: str, env: Mapping[str, str]
) -> Secret | None:
    """The password ``name`` from exactly one of ``name``, ``name_env`` (a variable's name)
    and ``name_file`` (a file's path; one trailing newline dropped)."""
    ways = [k for k in (name, f"{name}_env", f"{name}_file") if k in opts]
    if len(ways) > 1:
        raise ConfigError(f"{where}: give {name} one way, not {' and '.join(ways)}")
    if not ways:
        return None
    key = ways[0]
    value = opts[key]
    if key.endswith("_env"):
        got = env.get(value)
        if got is None:
            raise ConfigError(f"{where}: environment variable {value} (from {key}) is not set")
        return Secret(got)
    if key.endswith("_file"):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{where}: cannot read {key} {value}: {exc.__class__.__name__}"
            ) from None
        return Secret(text[:-1] if text.endswith("\n") else text)
    return Secret(value)


def _readable(path: str, key: str, where: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file() or not os.access(p, os.R_OK):
        raise ConfigError(f"{where}: {key} {path} is not a readable file")
    return str(p)


def _build(opts: dict[str, str], where: str, env: Mapping[str, str]) -> KafkaSecurity:
    protocol = opts.get("security_protocol", "PLAINTEXT").strip().upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"{where}: security_protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"
        )
    uses_ssl = protocol in ("SSL", "SASL_SSL")
    uses_sasl = protocol.startswith("SASL_")
    ssl_keys = sorted(k for k in opts if k.startswith("ssl_"))
    sasl_keys = sorted(k for k in opts if k.startswith("sasl_"))
    if ssl_keys and not uses_ssl:
        raise ConfigError(
            f"{where}: {', '.join(ssl_keys)} need security_protocol SSL or SASL_SSL "
            f"(it is {protocol})"
        )
    if sasl_keys and not uses_sasl:
        raise ConfigError(
            f"{where}: {', '.join(sasl_keys)} need security_protocol SASL_PLAINTEXT or "
            f"SASL_SSL (it is {protocol})"
        )
    mechanism = username = password = None
    if uses_sasl:
        mechanism = opts.get("sasl_mechanism", "PLAIN").strip().upper()
        if mechanism not in MECHANISMS:
            raise ConfigError(
                f"{where}: sasl_mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}"
            )
        username = opts.get("sasl_username") or None
        password = _secret(opts, "sasl_password", where, env)
        if username is None or password is None:
            raise ConfigError(
                f"{where}: SASL {mechanism} needs sasl_username and sasl_password "
                "(or sasl_password_file / sasl_password_env / KVSTREAM_KAFKA_SASL_PASSWORD)"
            )
    cafile = certfile = keyfile = None
    check_hostname = True
    context = None
    if uses_ssl:
        cafile = (
            _readable(opts["ssl_cafile"], "ssl_cafile", where) if "ssl_cafile" in opts else None
        )
        certfile = (
            _readable(opts["ssl_certfile"], "ssl_certfile", where)
            if "ssl_certfile" in opts
            else None
        )
        keyfile = (
            _readable(opts["ssl_keyfile"], "ssl_keyfile", where) if "ssl_keyfile" in opts else None
        )
        if keyfile is not None and certfile is None:
            raise ConfigError(f"{where}: ssl_keyfile needs ssl_certfile (the client certificate)")
        key_password = _secret(opts, "ssl_password", where, env)
        if key_password is not None and certfile is None:
            raise ConfigError(f"{where}: ssl_password needs ssl_certfile and ssl_keyfile")
        check_hostname = _bool(opts.get("ssl_check_hostname", "true"), "ssl_check_hostname", where)
        context = _ssl_context(
            cafile=cafile,
            certfile=certfile,
            keyfile=keyfile,
            password=key_password,
            check_hostname=check_hostname,
            where=where,
        )
    return KafkaSecurity(
        security_protocol=protocol,
        ssl_cafile=cafile,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        ssl_check_hostname=check_hostname,
        sasl_mechanism=mechanism,
        sasl_username=username,
        sasl_password=password,
        ssl_context=context,
    )


def _ssl_context(
    *,
    cafile: str | None,
    certfile: str | None,
    keyfile: str | None,
    password: Secret | None,
    check_hostname: bool,
    where: str,
) -> ssl.SSLContext:
    """A client context: verifies the broker's certificate against ``cafile`` (else the
    system's CAs), the host name too unless ``check_hostname`` is false; presents
    ``certfile``/``keyfile`` when given. What aiokafka's ``create_ssl_context`` builds, with
    the ssl module's current defaults (TLS 1.2 or later)."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{where}: ssl_cafile {cafile} does not load: {exc}") from None
    context.check_hostname = check_hostname
    if certfile is not None:
        try:
            # a callable, never None: OpenSSL would ask for an encrypted key's password
            # on the terminal
            context.load_cert_chain(
                certfile, keyfile, password.reveal if password is not None else _no_password
            )
        except (ssl.SSLError, OSError) as exc:
            hint = " (wrong ssl_password?)" if password is not None else ""
            raise ConfigError(
                f"{where}: the client certificate {certfile} "
                f"{'with key ' + keyfile + ' ' if keyfile else ''}does not load{hint}: "
                f"{exc.__class__.__name__}"
            ) from None
    return context


def _no_password() -> str:
    raise ssl.SSLError("the key is encrypted: give ssl_password (or ssl_password_file)")
