"""Generated request sequences, sent to LMCache's coordinator and kvatlas' alike.

A hypothesis state machine over what a fleet and its operators do: instances register
(sometimes with a bad body), heartbeat and leave; they declare capacity and send event
batches (stores of prompt prefixes in L1 or L2, private or shared, salted or not;
accesses; deletes; replays, stale incarnations, refused batches); clients look keys up
by token ids and by keys, list keys, read stats and usage; operators set quotas and
pins; prefetches and deletes go through both coordinators to one real LMCache server.
Every step is judged (``compare.py``) and the first mismatch fails the example with the
route, the field and both answers. Each example is a fresh `Run` (its own ids, model and
salts) and is undone at both coordinators when it ends. The module runs once per LMCache
version (``conftest.VERSIONS``); with 0.5.7rc2 an instance that left sends no L1 batch
until it registers again (0.5.7's gate refuses them, kvatlas takes them: the listed
``departed-l1-applied``, met by the membership scenario), and batches carry
``dropped_events`` as 0.5.7's servers stamp them.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from .harness import Pair, Target, report
from .ops import CHUNK, Run, tokens

pytestmark = [pytest.mark.lmcache]

N = st.integers(1, 3)
PROMPT = st.integers(0, 2)
CHUNKS = st.integers(1, 3)
SALT = st.sampled_from(["", "s1"])
PLACE = st.sampled_from([("l1", "dram", False), ("l2", "fs", False), ("l2", "s3", True)])
SETTINGS = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # the report names the request
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def machine(pair: Pair, target: Target) -> type[RuleBasedStateMachine]:
    class Fleet(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run = Run(pair, target)
            self.base = int(self.run.tag, 16) % 1_000_000 * 4096
            self.jobs: list[tuple[int, str, str]] = []
            self.dropped: dict[int, int] = {}
            self.start = len(pair.verdicts)

        def prompt(self, p: int, chunks: int = 3, extra: int = 1) -> list[int]:
            return tokens(self.base + p * 100_000, chunks, extra)

        def salt(self, s: str) -> str:
            return self.run.salt(1) if s else ""

        def closed(self, n: int, tier: str = "l1") -> bool:
            """An L1 batch LMCache 0.5.7's gate refuses for a departed instance."""
            return pair.version != "0.5.6" and tier == "l1" and self.run.iid(n) in self.run.departed

        def judge(self, since: int) -> None:
            bad = pair.mismatches(since)
            if bad:
                raise AssertionError(report(bad) + "\n" + history(pair, self.start))

        def step(self, fn: Any, *args: Any, **kw: Any) -> Any:
            since = len(pair.verdicts)
            out = fn(*args, **kw)
            self.judge(since)
            return out

        @initialize()
        def target_instance(self) -> None:
            self.step(self.run.register, 4, port=target.http_port)

        def teardown(self) -> None:
            self.run.close()
            self.step(self.run.get, "/instances/usage")  # undone alike at both

        # -- membership -------------------------------------------------------------

        @rule(n=N, p2p=st.booleans())
        def register(self, n: int, p2p: bool) -> None:
            extra = {"p2p_advertised_url": f"127.0.0.1:{8500 + n}", "mq_port": 5500 + n}
            self.step(self.run.register, n, **(extra if p2p else {}))

        @rule(
            n=N,
            bad=st.sampled_from(
                [
                    {"http_port": "x"},
                    {"metadata": {"a": 1}},
                    {"mq_port": 70000},
                ]
            ),
        )
        def register_badly(self, n: int, bad: dict[str, Any]) -> None:
            # an empty ip and port 0 are the membership scenario's (kvatlas takes them)
            obj = {"instance_id": self.run.iid(n), "ip": "127.0.0.1", "http_port": 1, **bad}
            self.step(self.run.send, "POST", "/instances", obj, "invalid")

        @rule(n=st.integers(1, 5))
        def heartbeat(self, n: int) -> None:
            self.step(self.run.heartbeat, n)

        @rule(n=N)
        def deregister(self, n: int) -> None:
            # as an LMCache server does: only once registered (a sender that never
            # registered and leaves is `unregistered-sender-leaves`, met by a scenario)
            if self.run.iid(n) in self.run.registered:
                self.step(self.run.deregister, n)

        @rule()
        def list_instances(self) -> None:
            self.step(self.run.get, "/instances")

        # -- events -----------------------------------------------------------------

        @rule(
            n=N,
            place=PLACE,
            capacity=st.sampled_from([0, 1 << 20, 1 << 30]),
            revision=st.integers(1, 3),
        )
        def config(
            self, n: int, place: tuple[str, str, bool], capacity: int, revision: int
        ) -> None:
            tier, backend, shared = place
            if self.closed(n, tier):
                return
            self.step(self.run.config, n, tier, backend, capacity, revision, shared)

        @rule(
            n=N,
            p=PROMPT,
            chunks=CHUNKS,
            place=PLACE,
            salt=SALT,
            size=st.sampled_from([1, 4096, 1 << 20]),
        )
        def store(
            self, n: int, p: int, chunks: int, place: tuple[str, str, bool], salt: str, size: int
        ) -> None:
            toks = self.prompt(p, chunks)
            hashes = self.run.chain(toks, self.salt(salt))
            parts = [toks[i * CHUNK : (i + 1) * CHUNK] for i in range(len(hashes))]
            tier, backend, shared = place
            if self.closed(n, tier):
                return
            self.step(
                self.run.place,
                n,
                "store",
                hashes,
                tier=tier,
                backend=backend,
                shared=shared,
                size=size,
                token_ids=parts,
                salt=self.salt(salt),
            )

        @rule(n=N, rise=st.sampled_from([0, 1, 4]))
        def report_dropped(self, n: int, rise: int) -> None:
            """An access batch stamped as 0.5.7's servers stamp every batch: the events
            this incarnation dropped so far (0.5.6's coordinator skips the field)."""
            if self.closed(n):
                return
            self.dropped[n] = self.dropped.get(n, 0) + rise
            self.step(self.run.events, self.run.batch(n, "access", dropped_events=self.dropped[n]))

        @rule(n=N, p=PROMPT, chunks=CHUNKS, salt=SALT)
        def access(self, n: int, p: int, chunks: int, salt: str) -> None:
            if self.closed(n):
                return
            hashes = self.run.chain(self.prompt(p, chunks), self.salt(salt))
            self.step(self.run.place, n, "access", hashes, salt=self.salt(salt))

        @rule(n=N, p=PROMPT, chunks=CHUNKS, place=PLACE, salt=SALT)
        def delete_event(
            self, n: int, p: int, chunks: int, place: tuple[str, str, bool], salt: str
        ) -> None:
            hashes = self.run.chain(self.prompt(p, chunks), self.salt(salt))[-1:]
            tier, backend, shared = place
            if self.closed(n, tier):
                return
            self.step(
                self.run.place,
                n,
                "delete",
                hashes,
                tier=tier,
                backend=backend,
                shared=shared,
                salt=self.salt(salt),
            )

        @rule(
            n=N,
            fault=st.sampled_from(
                [
                    "duplicate",
                    "stale",
                    "short-hash",
                    "invalid-tier",
                    "negative-size",
                    "bad-hex",
                    "no-fields",
                ]
            ),
        )
        def bad_batch(self, n: int, fault: str) -> None:
            if self.closed(n):
                return
            r = self.run
            s = r.streams.setdefault(r.iid(n), type(next(iter(r.streams.values())))())
            nxt = s.seq + 1
            key = r.key("ab" * 32)
            b: dict[str, Any]
            if fault == "duplicate":
                b = r.batch(n, "access", seq=max(s.seq, 1))
            elif fault == "stale":  # older than the stream's incarnation (once it has one)
                if not s.seq:
                    return
                b = r.batch(n, "access", seq=nxt, incarnation=s.incarnation - 1)
            elif fault == "short-hash":
                # at the last seq: a duplicate LMCache drops, so the streams stay as one
                # (a stream with no seq yet has nothing to repeat)
                if not s.seq:
                    return
                b = r.batch(n, "store", seq=s.seq, entries=[{"key": r.key("ab" * 16)}])
            elif fault == "invalid-tier":
                b = r.batch(n, "store", seq=nxt, tier="all")
            elif fault == "negative-size":
                b = r.batch(n, "store", seq=nxt, entries=[{"key": key, "size_bytes": -1}])
            elif fault == "bad-hex":
                b = r.batch(n, "store", seq=nxt, entries=[{"key": r.key("zz" * 32)}])
            else:
                b = {"instance_id": r.iid(n), "seq": nxt}
            kind = fault if fault in ("duplicate", "stale", "short-hash") else "invalid"
            self.step(r.events, b, kind=kind)

        # -- reads ------------------------------------------------------------------

        @rule(p=PROMPT, chunks=CHUNKS, extra=st.sampled_from([0, 1, 100]), salt=SALT)
        def lookup_tokens(self, p: int, chunks: int, extra: int, salt: str) -> None:
            self.step(self.run.lookup_tokens, self.prompt(p, chunks, extra), self.salt(salt))

        @rule(p=PROMPT, chunks=CHUNKS, salt=SALT)
        def lookup_keys(self, p: int, chunks: int, salt: str) -> None:
            hashes = self.run.chain(self.prompt(p, chunks), self.salt(salt))
            self.step(self.run.lookup_keys, [*hashes, "00" * 32], self.salt(salt))

        @rule(
            n=N,
            tier=st.sampled_from(["", "l1", "l2", "all"]),
            backend=st.sampled_from(["", "dram", "fs"]),
            offset=st.integers(0, 3),
            limit=st.integers(1, 4),
        )
        def list_keys(self, n: int, tier: str, backend: str, offset: int, limit: int) -> None:
            q = f"instance_id={self.run.iid(n)}&offset={offset}&limit={limit}"
            q += f"&tier={tier}" if tier else ""
            q += f"&backend={backend}" if backend else ""
            self.step(self.run.get, f"/directory/keys?{q}")

        @rule()
        def stats(self) -> None:
            self.step(self.run.get, "/directory/stats")

        @rule(n=st.integers(0, 5))
        def usage(self, n: int) -> None:
            path = "/instances/usage" if n == 0 else f"/instances/{self.run.iid(n)}/usage"
            self.step(self.run.get, path)

        # -- quotas and pins ----------------------------------------------------------

        @rule(gb=st.one_of(st.none(), st.sampled_from([0.0, 0.5, 2.0, -1.0])))
        def quota_config(self, gb: float | None) -> None:
            kind = "invalid" if gb is not None and gb < 0 else "valid"
            self.step(self.run.quota_config, gb, kind)
            self.step(self.run.get, "/quota/config")

        @rule(
            salt=st.sampled_from(["s1", "s2", "_default"]),
            gb=st.sampled_from([0, 0.25, 1.5, -1, "x"]),
        )
        def set_quota(self, salt: str, gb: Any) -> None:
            name = salt if salt == "_default" else self.run.salt(int(salt[1]))
            kind = "valid" if isinstance(gb, float | int) and gb >= 0 else "invalid"
            self.step(self.run.set_quota, name, gb, kind)

        @rule(
            salt=st.sampled_from(["s1", "s2", "_default"]), tier=st.sampled_from(["", "l1", "l2"])
        )
        def read_quota(self, salt: str, tier: str) -> None:
            name = salt if salt == "_default" else self.run.salt(int(salt[1]))
            q = f"?tier={tier}" if tier else ""
            self.step(self.run.get, f"/quota/{name}{q}")
            self.step(self.run.get, f"/quota{q}")

        @rule(salt=st.sampled_from(["s1", "s2", "_default"]))
        def delete_quota(self, salt: str) -> None:
            name = salt if salt == "_default" else self.run.salt(int(salt[1]))
            self.step(self.run.delete_quota, name)

        @rule(
            p=PROMPT, chunks=CHUNKS, extra=st.sampled_from([0, 1]), salt=SALT, unpin=st.booleans()
        )
        def pin(self, p: int, chunks: int, extra: int, salt: str, unpin: bool) -> None:
            self.step(self.run.pin, self.prompt(p, chunks, extra), self.salt(salt), unpin)

        @rule(salt=SALT, offset=st.integers(0, 2), limit=st.integers(1, 3))
        def list_pins(self, salt: str, offset: int, limit: int) -> None:
            q = f"model_name={self.run.model}&offset={offset}&limit={limit}"
            q += f"&cache_salt={self.salt(salt)}" if salt else ""
            self.step(self.run.get, f"/cache/pins?{q}")

        # -- forwarded to the LMCache server -------------------------------------------

        @rule(p=PROMPT, chunks=st.integers(0, 2), n=st.sampled_from([4, 4, 5]))
        def prefetch(self, p: int, chunks: int, n: int) -> None:
            toks = self.prompt(p, chunks) if chunks else self.prompt(p, 0, 10)
            _ex, lm_rid, kv_rid = self.step(self.run.prefetch, n, toks)
            if lm_rid and kv_rid:
                self.jobs.append((n, lm_rid, kv_rid))

        @rule()
        def poll(self) -> None:
            if self.jobs:
                n, lm_rid, kv_rid = self.jobs.pop(0)
                self.step(self.run.poll, n, lm_rid, kv_rid)

        @rule(
            p=PROMPT,
            chunks=st.integers(0, 2),
            tier=st.sampled_from(["l1", "l2", "all"]),
            force=st.booleans(),
            n=st.sampled_from([4, 4, 5]),
        )
        def delete(self, p: int, chunks: int, tier: str, force: bool, n: int) -> None:
            toks = self.prompt(p, chunks) if chunks else self.prompt(p, 0, 10)
            self.step(self.run.delete, n, toks, tier, force)

    return Fleet


def history(pair: Pair, start: int, limit: int = 60) -> str:
    """The example's requests so far, with both statuses."""
    lines = ["the example's requests (LMCache status / kvatlas status):"]
    for v in pair.verdicts[start:][-limit:]:
        ex = v.exchange
        sent = (ex.call.body or b"")[:150].decode("utf-8", "replace")
        lines.append(f"  {ex.lm_status}/{ex.kv_status} {ex.call.method} {ex.call.path} {sent}")
    return "\n".join(lines)


def test_generated_sequences_answered_alike(pair: Pair, target: Target) -> None:
    since = len(pair.verdicts)
    try:
        run_state_machine_as_test(machine(pair, target), settings=SETTINGS)
    except Exception as exc:
        # The coordinators' state outlives an example, so hypothesis' replay of a failing
        # one may fail elsewhere (it then says "flaky"): every mismatch seen is the report.
        bad = pair.mismatches(since)
        if not bad:
            raise
        raise AssertionError(report(bad)) from exc
