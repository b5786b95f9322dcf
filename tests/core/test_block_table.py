"""The device tier's block table and token hashes: the compiled `_blocks` and its Python
twin give the same answers on random workloads; the local hash is Dynamo's (its value
for known tokens, and `dynamo.llm.compute_block_hash_for_seq` itself where .venv-dynamo
exists); content keys carry the LoRA, the salt and the parent."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
from pathlib import Path

import pytest

from kvatlas.core.coordinator import block_table as bt
from kvatlas.core.errors import InvalidInput

compiled = pytest.importorskip("kvatlas.core._blocks", reason="the C extension was not built")
ROOT = Path(__file__).resolve().parents[2]


def _u64s(raw: bytes) -> list[int]:
    return [v for (v,) in struct.iter_unpack("<Q", raw)]


def test_local_hash_is_dynamos() -> None:
    # dynamo.llm.compute_block_hash_for_seq(list(range(32)), 16) in ai-dynamo-runtime 1.6.1
    want = [15310707395893867146, 15292316782987903195]
    assert _u64s(compiled.local_hashes(list(range(32)), 16, bt.DYNAMO_SEED)) == want
    assert _u64s(bt.py_local_hashes(list(range(32)), 16, bt.DYNAMO_SEED)) == want


def test_local_hash_against_dynamos_own_function() -> None:
    venv = Path(os.environ.get("KVATLAS_DYNAMO_VENV", ROOT / ".venv-dynamo"))
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-dynamo (scripts/dynamo_env.sh)")
    rng = random.Random(5)
    tokens = [rng.randrange(2**32) for _ in range(100)]
    script = (
        "import json, sys; from dynamo.llm import compute_block_hash_for_seq as c;"
        "t = json.loads(sys.argv[1]);"
        "print(json.dumps([c(t, 16), c(t, 16, lora_name='ad-1')]))"
    )
    out = subprocess.run(
        [str(python), "-c", script, str(tokens)], capture_output=True, text=True, check=True
    )
    plain, lora = json.loads(out.stdout)
    assert _u64s(bt.local_hashes(tokens, 16, bt.DYNAMO_SEED)) == plain
    assert _u64s(bt.local_hashes(tokens, 16, bt.lora_seed("ad-1"))) == lora


def test_twins_agree_on_hashes() -> None:
    rng = random.Random(1)
    for _ in range(50):
        toks = [rng.randrange(2**32) for _ in range(rng.randrange(0, 80))]
        size = rng.randrange(1, 9)
        seed = bt.lora_seed(rng.choice([None, "a", "b"]))
        extras = [rng.randrange(3) for _ in range(rng.randrange(0, 5))] or None
        root = rng.randrange(2**64)
        assert compiled.local_hashes(toks, size, seed) == bt.py_local_hashes(toks, size, seed)
        assert compiled.content_keys(toks, size, seed, root, extras) == bt.py_content_keys(
            toks, size, seed, root, extras
        )
        raw = struct.pack(f"<{len(toks)}I", *toks)
        assert compiled.content_keys(raw, size, seed, root, extras) == compiled.content_keys(
            toks, size, seed, root, extras
        )


def _workload(table: bt.BlockTableType, rng: random.Random) -> list[object]:
    out: list[object] = []
    for _ in range(4000):
        op = rng.random()
        if op < 0.6:
            n = rng.randint(1, 4)
            hashes = [rng.randrange(300) for _ in range(n)]
            parent = rng.choice([None, rng.randrange(300)])
            pc = table.content(parent) if parent is not None else None
            tokens = [rng.randrange(5) for _ in range(n * 4)] if rng.random() < 0.8 else None
            extras = [rng.randrange(3) for _ in range(n)] if rng.random() < 0.3 else None
            bit = 1 << rng.randrange(8)
            out.append(table.store(hashes, parent, pc, tokens, 4, 1337, extras, bit))
        elif op < 0.9:
            hashes = [rng.randrange(300) for _ in range(3)]
            out.append(table.remove(hashes, 1 << rng.randrange(8)))
        elif op < 0.903:
            out.append(table.clear())
        else:
            keys = bt.py_content_keys([rng.randrange(5) for _ in range(16)], 4, 1337, 0)
            out.append((table.run(keys, [0xF]), table.run(keys, []), table.masks(keys)))
        out.append(len(table))
    out.append(sorted(table.items(), key=lambda item: item[0]))
    return out


def test_twins_agree_on_a_random_workload() -> None:
    """Stores (chained, tokenless, unresolved parents, copies), removals, clears and
    lookups: the same answers, step by step, and the same table at the end; the table
    grows and rebuilds through its tombstones on the way."""
    for seed in range(3):
        want = _workload(bt.PyBlockTable(), random.Random(seed))
        got = _workload(compiled.BlockTable(), random.Random(seed))
        assert got == want
        assert any(isinstance(x, tuple) and x and isinstance(x[0], tuple) and x[0][0] for x in got)


def test_the_table_grows_and_keeps_every_block() -> None:
    table = compiled.BlockTable()
    rng = random.Random(2)
    keys = list({rng.getrandbits(63) for _ in range(20_000)})
    assert len(keys) == 20_000
    for i in range(0, len(keys), 16):
        table.store(keys[i : i + 16], None, None, list(range(64)), 4, 1337, None, 1)
    assert len(table) == 20_000 and table.nbytes > 20_000 * 41
    assert table.remove(keys[::2], 1) == 10_000
    assert len(table) == 10_000 and all(table.mask(k) == 1 for k in keys[1::2])


def test_content_keys_carry_lora_salt_and_parent() -> None:
    tokens = list(range(32))
    plain = bt.prompt_keys(tokens, 16)
    assert bt.prompt_keys(tokens, 16, lora_name="a") != plain
    assert bt.prompt_keys(tokens, 16, cache_salt="s")[:8] != plain[:8]
    assert bt.prompt_keys(tokens, 16, cache_salt="s")[8:] != plain[8:]  # the chain carries it
    second = bt.content_keys(tokens[16:], 16, bt.DYNAMO_SEED, int.from_bytes(plain[:8], "little"))
    assert second == plain[8:]
    with pytest.raises(InvalidInput):
        bt.prompt_keys([2**32], 1)
    with pytest.raises(InvalidInput):
        bt.prompt_keys([-1], 1)


def test_twins_agree_while_the_indexes_grow_and_rebuild() -> None:
    """Thousands of blocks sharing few contents (so one content key names several
    blocks) stored and removed until both indexes have been rebuilt: the same answers."""

    def workload(table: bt.BlockTableType, rng: random.Random) -> list[object]:
        out: list[object] = []
        for _ in range(20_000):
            if rng.random() < 0.55:
                n = rng.randint(1, 8)
                hashes = [rng.randrange(3000) for _ in range(n)]
                tokens = [rng.randrange(3) for _ in range(2 * n)]
                out.append(table.store(hashes, None, None, tokens, 2, 1, None, 1))
            else:
                out.append(table.remove([rng.randrange(3000) for _ in range(4)], 1))
            out.append(len(table))
            if rng.random() < 0.01:
                keys = bt.py_content_keys([rng.randrange(3) for _ in range(8)], 2, 1, 0)
                out.append(table.masks(keys))
        out.append(sorted(table.items(), key=lambda item: item[0]))
        return out

    table = compiled.BlockTable()
    first = table.nbytes
    assert workload(table, random.Random(3)) == workload(bt.PyBlockTable(), random.Random(3))
    assert table.nbytes > first  # grown (and rebuilt on the way)
