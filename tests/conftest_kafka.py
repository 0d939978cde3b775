"""Kafka fixtures: one tansu broker per test session behind a fault-injecting proxy.

``kafka`` gives a :class:`KafkaEnv` whose ``bootstrap`` goes through a :class:`FaultProxy`
(the broker advertises the proxy's port, so every connection does), restored after each test.
``kafka_factory`` starts dedicated brokers (for tests that kill and restart one).
Tests using them are marked ``kafka``; they skip when tansu is not available.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fault_proxy import FaultProxy
from kafka_broker import BrokerUnavailable, KafkaBroker, free_port, tansu_binary

_topic_ids = itertools.count()


@dataclass
class KafkaEnv:
    """A broker and the proxy in front of it."""

    broker: KafkaBroker
    proxy: FaultProxy
    topics: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.proxy.address

    def topic(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(_topic_ids)}"
        self.topics.append(name)
        return name

    def heal(self) -> None:
        """Undo faults: proxy forwarding, broker running."""
        self.proxy.restore()
        if self.broker.proc is None or self.broker.proc.poll() is not None:
            self.broker.start()

    def close(self) -> None:
        self.proxy.close()
        self.broker.close()


def start_env() -> KafkaEnv:
    """A fresh broker behind a fresh proxy (skips the test when tansu is missing)."""
    try:
        tansu_binary()
    except BrokerUnavailable as exc:
        pytest.skip(f"no Kafka broker for tests: {exc}")
    broker_port = free_port()
    proxy = FaultProxy("127.0.0.1", broker_port).start()
    broker = KafkaBroker(broker_port, advertise_port=proxy.port)
    try:
        broker.start()
    except BaseException:
        proxy.close()
        broker.close()
        raise
    return KafkaEnv(broker, proxy)


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
def kafka_factory() -> Iterator[Callable[[], KafkaEnv]]:
    """Start dedicated brokers (each behind its own proxy), closed after the test."""
    envs: list[KafkaEnv] = []

    def make() -> KafkaEnv:
        env = start_env()
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()
