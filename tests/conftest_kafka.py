"""Kafka fixtures: one tansu broker per test session behind a fault-injecting proxy.

``kafka`` gives a :class:`KafkaEnv` whose ``bootstrap`` goes through a :class:`FaultProxy`
(the broker advertises the proxy's port, so every connection does), restored after each test.
``kafka_factory`` starts dedicated brokers (for tests that kill, freeze and restart one);
``kafka_factory(durable=True)`` gives one whose storage (moto's S3 server) survives ``kill -9``.
Tests using them are marked ``kafka``; they skip when tansu is not available.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fault_proxy import FaultProxy
from kafka_broker import BrokerUnavailable, KafkaBroker, S3Storage, free_port, tansu_binary

_topic_ids = itertools.count()


@dataclass
class KafkaEnv:
    """A broker and the proxy in front of it."""

    broker: KafkaBroker
    proxy: FaultProxy
    topics: list[str] = field(default_factory=list)
    storage: S3Storage | None = None

    @property
    def bootstrap(self) -> str:
        return self.proxy.address

    def topic(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(_topic_ids)}"
        self.topics.append(name)
        return name

    def heal(self) -> None:
        """Undo faults: proxy forwarding, broker thawed and running."""
        self.proxy.restore()
        self.broker.thaw()
        if self.broker.proc is None or self.broker.proc.poll() is not None:
            self.broker.start()

    def close(self) -> None:
        self.proxy.close()
        self.broker.close()
        if self.storage is not None:
            self.storage.close()


def start_env(*, durable: bool = False) -> KafkaEnv:
    """A fresh broker behind a fresh proxy (skips the test when tansu is missing). With
    ``durable`` its storage is moto's S3 server, so ``broker.restart()`` keeps the data
    (skips when moto is not installed)."""
    try:
        tansu_binary()
        storage = S3Storage().start() if durable else None
    except BrokerUnavailable as exc:
        pytest.skip(f"no Kafka broker for tests: {exc}")
    broker_port = free_port()
    proxy = FaultProxy("127.0.0.1", broker_port).start()
    broker = KafkaBroker(broker_port, advertise_port=proxy.port, storage=storage)
    try:
        broker.start()
    except BaseException:
        proxy.close()
        broker.close()
        if storage is not None:
            storage.close()
        raise
    return KafkaEnv(broker, proxy, storage=storage)


@pytest.fixture(scope="session")
def kafka_session() -> Iterator[KafkaEnv]:
    env = start_env()
    yield env
    env.close()


@pytest.fixture
def kafka(kafka_session: KafkaEnv) -> Iterator[KafkaEnv]:
    """The session's broker, healed after the test."""
    kafka_session.heal()
    yield kafka_session
    kafka_session.heal()


@pytest.fixture
def kafka_factory() -> Iterator[Callable[..., KafkaEnv]]:
    """Start dedicated brokers (each behind its own proxy), closed after the test;
    ``make(durable=True)`` for one whose data survives ``kill -9`` and restart."""
    envs: list[KafkaEnv] = []

    def make(*, durable: bool = False) -> KafkaEnv:
        env = start_env(durable=durable)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()
