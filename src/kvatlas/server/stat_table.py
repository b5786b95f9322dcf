"""A stat is written once: one declarative table per stats type, from which both its
``/status`` section and its Prometheus metric families are generated.

A row says everything about one stat: its field in the ``/status`` section, its metric's
name, the kind (counter or gauge), the help text, its label, and how to read it from the
stats snapshot. `Stat` is a number (or numbers by one label); `Field` is a value only
``/status`` shows (a name, a list); `Items` is a list of per-item sections (per peer) an
`Each` table describes. The sections' msgspec Structs stay explicit in
``wire.server_status`` (their readers decode them typed); ``tests/server/test_stat_tables.py``
holds each table's ``/status`` names equal to its Struct's fields.

Owns the row kinds and the generation. Must not: name a stats type or a metric (the
tables do, beside their stats), count anything, hold state, or register a collector.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Generic, TypeVar, cast

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

S = TypeVar("S")
I = TypeVar("I")  # noqa: E741  (an item of a stats snapshot: a peer, a salt)
T = TypeVar("T", bound=msgspec.Struct)

Family = CounterMetricFamily | GaugeMetricFamily
Reading = float | Mapping[str, float] | None
"""What a `Stat` reads: a number, numbers by its label's values, or None (no sample;
``null`` in ``/status``)."""

# The row classes are frozen without slots: a row is built through its generic alias
# (``Stat[P2PStats](...)``, so that mypy types the lambdas), which sets ``__orig_class__``
# on the instance, and a slotted frozen dataclass answers that with a TypeError.

INSTANCE_LABEL = "instance_id"
PREFIX = "kvatlas_server_"


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"


COUNTER = Kind.COUNTER
GAUGE = Kind.GAUGE


@dataclass(frozen=True)
class Stat(Generic[S]):
    """One number of a stats type, shown in ``/status``, exported, or both."""

    status: str | None
    """Its field in the ``/status`` section; None: not shown there."""
    metric: str | None
    """Its metric family's full name (a counter's without ``_total``); None: not
    exported."""
    kind: Kind
    help: str
    read: Callable[[S], Reading]
    label: str | None = None
    """A by-label stat: ``read`` gives {label value: number}; ``/status`` shows that
    mapping, the metric one sample per value (sorted)."""
    shown: Callable[[float], float] | None = None
    """The ``/status`` form of a number (milliseconds of seconds, rounded); the metric
    keeps what ``read`` gives."""

    def __post_init__(self) -> None:
        if self.status is None and self.metric is None:
            raise ValueError(f"a stat shown nowhere: {self.help!r}")
        if self.metric is not None and not self.metric.startswith(PREFIX):
            raise ValueError(f"{self.metric}: a server metric starts with {PREFIX}")
        if self.label is not None and self.shown is not None:
            raise ValueError(f"{self.metric or self.status}: a by-label stat is shown as read")


@dataclass(frozen=True)
class Field(Generic[S]):
    """A value only ``/status`` shows (a name, a list), as ``read`` gives it."""

    status: str
    read: Callable[[S], object]


@dataclass(frozen=True)
class Items(Generic[S, I]):
    """A list of per-item sections in ``/status`` (one per peer), and the item table's
    metric families labelled by each item's key."""

    status: str
    read: Callable[[S], Iterable[I]]
    each: Each[I, Any]
    """Any: the items' Struct is the table's own (mypy cannot carry it through a row)."""


Row = Stat[S] | Field[S] | Items[S, Any]


@dataclass(frozen=True)
class Table(Generic[S]):
    """The stats of one type: what its ``/status`` section holds, what it exports."""

    rows: tuple[Row[S], ...]
    _getters: tuple[tuple[str, Callable[[S], object]], ...] = dataclass_field(
        init=False, repr=False, compare=False
    )
    """Each ``/status`` field's name and its value from the stats, decided once per row
    (``/status`` is asked often by fleet views; no row kind is tested per request)."""

    def __post_init__(self) -> None:
        names = self.status_names()
        if len(set(names)) != len(names):
            raise ValueError(f"a /status field named twice: {names}")
        metrics = [r.metric for r in self.stats() if r.metric is not None]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"a metric named twice: {metrics}")
        getters = tuple((r.status, _getter(r)) for r in self.rows if r.status is not None)
        object.__setattr__(self, "_getters", getters)  # frozen: set once, here

    def stats(self) -> Iterator[Stat[S]]:
        return (r for r in self.rows if isinstance(r, Stat))

    def status_names(self) -> tuple[str, ...]:
        return tuple(r.status for r in self.rows if r.status is not None)

    def metric_names(self) -> tuple[str, ...]:
        """Every family this table exports, its items' included."""
        own = tuple(r.metric for r in self.stats() if r.metric is not None)
        nested = (n for r in self.rows if isinstance(r, Items) for n in r.each.table.metric_names())
        return own + tuple(nested)

    def fields(self, stats: S) -> dict[str, Any]:
        """The ``/status`` section's fields, by name (Any: each is its Struct field's
        type, which msgspec checks where the document is decoded)."""
        return {name: get(stats) for name, get in self._getters}

    def section(self, struct: type[T], stats: S, **given: object) -> T:
        """The ``/status`` section as its Struct; ``given``: its fields from outside the
        stats (the region's name)."""
        return struct(**self.fields(stats), **given)

    def families(self, instance_id: str, stats: S) -> Iterator[Family]:
        """Every exported row's family, with one sample (or one per label value)."""
        yield from self.scoped_families([INSTANCE_LABEL], [((instance_id,), stats)])

    def scoped_families(
        self, labels: list[str], scopes: list[tuple[tuple[str, ...], S]]
    ) -> Iterator[Family]:
        """Each exported row's family over ``scopes``: (values of ``labels``, stats)
        pairs, one sample each (items: one per item of each)."""
        for r in self.rows:
            if isinstance(r, Stat) and r.metric is not None:
                yield _family(r, r.metric, labels, scopes)
            elif isinstance(r, Items):
                yield from r.each.nested_families(labels, scopes, r.read)


@dataclass(frozen=True)
class Each(Generic[I, T]):
    """Items of one kind (peers, cache salts), each read by ``table``: one ``struct``
    per item in ``/status``, and per exported row one family with the item's ``key`` as
    the ``label``."""

    table: Table[I]
    struct: type[T]
    label: str
    key: Callable[[I], str]

    def sections(self, items: Iterable[I]) -> list[T]:
        return [self.table.section(self.struct, i) for i in items]

    def by_key(self, items: Iterable[I]) -> dict[str, T]:
        return {self.key(i): self.table.section(self.struct, i) for i in items}

    def families(self, instance_id: str, items: Iterable[I]) -> Iterator[Family]:
        yield from self.table.scoped_families(
            [INSTANCE_LABEL, self.label], [((instance_id, self.key(i)), i) for i in items]
        )

    def nested_families(
        self,
        labels: list[str],
        scopes: list[tuple[tuple[str, ...], S]],
        read: Callable[[S], Iterable[I]],
    ) -> Iterator[Family]:
        """The families of items read from each of an outer table's scopes."""
        yield from self.table.scoped_families(
            [*labels, self.label],
            [((*values, self.key(i)), i) for values, stats in scopes for i in read(stats)],
        )


def _getter(row: Row[S]) -> Callable[[S], object]:
    """How a row's ``/status`` value is read: a number as read or in its shown form, a
    by-label stat's mapping copied, items as their sections."""
    if isinstance(row, Field):
        return row.read
    if isinstance(row, Items):
        each, items = row.each, row.read
        return lambda stats: each.sections(items(stats))
    read, shown = row.read, row.shown
    if row.label is not None:
        return lambda stats: dict(cast(Mapping[str, float], read(stats)))
    if shown is None:
        return read

    def read_shown(stats: S) -> object:
        value = read(stats)
        return None if value is None else shown(cast(float, value))

    return read_shown


def _family(
    row: Stat[S], name: str, labels: list[str], scopes: list[tuple[tuple[str, ...], S]]
) -> Family:
    labels = [*labels, row.label] if row.label is not None else labels
    cls = CounterMetricFamily if row.kind is COUNTER else GaugeMetricFamily
    family = cls(name, row.help, labels=labels)
    for values, stats in scopes:
        value = row.read(stats)
        if isinstance(value, Mapping):
            for label_value, n in sorted(value.items()):
                family.add_metric([*values, label_value], n)
        elif value is not None:
            family.add_metric(list(values), value)
    return family


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded to the microsecond (``/status``'s ``*_ms``)."""
    return round(seconds * 1000, 3)
