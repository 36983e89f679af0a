"""GGUF files whose metadata is hostile or wrong (issue 47): what a file declares is bounded before it is read, and
each bad value is refused at load with an error naming the file and the key.

The files are made here from the GGUF format itself (struct-packed records, or a good file rewritten with the gguf
package's own GGUFReader / GGUFWriter), never with allspark's reader. Cases that used to run away (an array of 2^62
elements looped forever, 10^7 blocks or a 2^24 context cost gigabytes) run in a child process with a time limit
and a cap on its data segment, so that a regression fails instead of hanging or exhausting the machine."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V
from gguf_writer import write_gguf

from allspark_server import HuggingFaceModel
from allspark_server.layers.rotary import RotaryEmbedding, rope_frequencies
from allspark_server.loader.hf_model import ModelSerializerException
from allspark_server.loader.tiny_model import build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALIGN = 32                         # GGUF's default general.alignment
CHILD_DATA_BYTES = 3 << 30         # a child's data segment (heap and anonymous maps): a runaway fails, not the host
CHILD_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    """A tiny Llama with F32 tensors and its tokenizer, as llama.cpp's converter writes it."""
    d = str(tmp_path_factory.mktemp("gguf_limits"))
    model = build_tiny_model(d, "llama_mha_tied", num_layers=1)
    path = os.path.join(d, "model", "tiny.gguf")      # a folder of its own: the tokenizer comes from the file only
    os.makedirs(os.path.dirname(path))
    return write_gguf(model, path, tokenizer_dir=d, chat_template="{{ messages[0]['content'] }}")


# ---- files made from the format ----------------------------------------------------------------------------
def gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_record(key: str, vtype: int, payload: bytes) -> bytes:
    """A metadata record: the key, the value type, the value."""
    return gguf_string(key.encode()) + struct.pack("<I", vtype) + payload


def with_records(path: str, records: list[bytes], out: str) -> str:
    """`path` with more metadata records, put first, and a filler record (a UINT8) that makes what is added a
    multiple of the alignment: the tensor data stays aligned and each tensor's offset (from the data section's
    start) stays right."""
    added = b"".join(records)
    filler = kv_record("filler", V.UINT8, b"\0")
    key = "filler" + "_" * (-(len(added) + len(filler)) % ALIGN)
    added += kv_record(key, V.UINT8, b"\0")
    data = open(path, "rb").read()
    kv_count = struct.unpack_from("<Q", data, 16)[0]
    with open(out, "wb") as f:
        f.write(data[:16] + struct.pack("<Q", kv_count + len(records) + 1) + added + data[24:])
    return out


def rewritten(path: str, out: str, meta: dict | None = None, drop=()) -> str:
    """`path` (F32 tensors) rewritten by the gguf package with `meta` {key: (value, type[, element type])} set."""
    meta = meta or {}
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta or key in drop:
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, field.types[-1] if vtype == V.ARRAY else None)
    for key, (value, *types) in meta.items():
        w.add_key_value(key, value, *types)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tensor_info_at(data: bytes, name: str) -> int:
    """Where the tensor info of `name` keeps its type id (u32) and data offset (u64) in the file."""
    name_bytes = name.encode()
    at = data.index(gguf_string(name_bytes)) + 8 + len(name_bytes)
    return at + 4 + 8 * struct.unpack_from("<I", data, at)[0]


def patched(path: str, out: str, edit) -> str:
    data = bytearray(open(path, "rb").read())
    edit(data)
    with open(out, "wb") as f:
        f.write(bytes(data))
    return out


def refused(path: str, *parts: str) -> str:
    """Loading `path` fails with a ModelSerializerException naming the file and each of `parts`."""
    with pytest.raises(ModelSerializerException) as e:
        HuggingFaceModel(path, "bad")
    message = str(e.value)
    for part in (os.path.basename(path), *parts):
        assert part in message, (part, message)
    return message


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_DATA, (int(sys.argv[5]), int(sys.argv[5])))
    from allspark_server import HuggingFaceModel
    from allspark_server.loader.hf_model import ModelSerializerException
    path, what = sys.argv[1], sys.argv[2]
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # noqa: E731
    before, start = peak(), time.monotonic()
    try:
        loader = HuggingFaceModel(path, "m", user_set_data_type="float32")
        if what == "tokenizer":
            loader.get_tokenizer()
        elif what == "engine":
            sys.path.insert(0, sys.argv[3])
            from helpers import greedy, start_engine
            loader.load_model().serialize(None, model_output_dir=sys.argv[4]).free_model()
            before = peak()
            engine = start_engine(loader, "m", max_length=loader.hf_config["max_position_embeddings"],
                                  kv_bytes=64 << 20, max_batch=2)
            print("TOKENS", greedy(engine, "m", [5, 6, 7], 4))
            engine.release_model("m")
        print("RESULT", json.dumps({"ok": True, "grew": peak() - before, "s": time.monotonic() - start}))
    except ModelSerializerException as e:
        print("RESULT", json.dumps({"ok": False, "error": str(e), "s": time.monotonic() - start}))
""")


def in_child(path: str, tmp_path, what: str = "config") -> dict:
    """Load `path` (`what`: the config, also the tokenizer, or an Engine install with a 64 MiB KV budget at the
    file's context) in a child process bounded in time and data; its result (ok, error, grew: peak RSS growth). The
    child sets its own data limit first thing: with a preexec_fn the fork runs Python's at-fork handlers in the child
    (gRPC's among them, this process having loaded gRPC), and once such a child aborted in gRPC's poller (EBADF in
    epoll_wait, rc -6)."""
    env = dict(os.environ, PYTHONPATH=ROOT, HOME=str(tmp_path))      # a tokenizer cache of its own
    args = [sys.executable, "-c", CHILD, path, what, os.path.join(ROOT, "tests"), str(tmp_path / "out"),
            str(CHILD_DATA_BYTES)]
    try:
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path} ran past {CHILD_TIMEOUT_S} s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed (rc {p.returncode}): {p.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    result["tokens"] = [ln for ln in p.stdout.splitlines() if ln.startswith("TOKENS ")]
    return result


# ---- metadata that never ends --------------------------------------------------------------------------------
def test_an_array_longer_than_the_file_is_refused_at_once(tmp_path):
    """The 49-byte file of the issue: a header and one key, a UINT8 array declaring 2^62 elements (gguf's reader
    read 0 bytes at the end of the file without an error, forever)."""
    path = str(tmp_path / "endless.gguf")
    record = kv_record("a", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**62))
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + record)
    assert os.path.getsize(path) == 49
    result = in_child(path, tmp_path)
    assert not result["ok"] and result["s"] < 30, result
    for part in ("endless.gguf", "'a'", f"declares an array of {2**62} values", "0 bytes left"):
        assert part in result["error"], (part, result)


def test_a_long_array_no_one_reads_costs_little(good, tmp_path):
    """A good file plus one 20 M-element UINT8 array under a key allspark does not read: it loads (the config, and
    the tokenizer, which transformers builds from the file's metadata) in little memory (gguf's reader made a numpy
    object of each element: 5 GB)."""
    count = 20_000_000
    record = kv_record("junk.blob", V.ARRAY, struct.pack("<IQ", V.UINT8, count) + bytes(count))
    path = with_records(good, [record], str(tmp_path / "junk.gguf"))
    result = in_child(path, tmp_path, "tokenizer")
    assert result["ok"], result
    assert result["grew"] < 400 << 20, result


def test_arrays_nested_5000_deep_are_refused(good, tmp_path):
    payload = struct.pack("<IQ", V.UINT8, 0)
    for _ in range(5000):
        payload = struct.pack("<IQ", V.ARRAY, 1) + payload
    path = with_records(good, [kv_record("deep", V.ARRAY, payload)], str(tmp_path / "deep.gguf"))
    refused(path, "'deep", "nests arrays more than")


def test_an_array_of_more_than_2_21_values_is_refused_when_read(good, tmp_path):
    """Arrays are decoded only when read, at most 2^21 values (a vocabulary is < 10^6): here a per-layer head
    count of 2^21 + 1 values."""
    count = 2**21 + 1
    path = rewritten(good, str(tmp_path / "heads1.gguf"), drop=("llama.attention.head_count",))
    record = kv_record("llama.attention.head_count", V.ARRAY, struct.pack("<IQ", V.UINT8, count) + bytes([4]) * count)
    refused(with_records(path, [record], str(tmp_path / "heads.gguf")), "'llama.attention.head_count'",
            f"array of {count} values")


# ---- sizes from the file ------------------------------------------------------------------------------------
def test_a_block_count_without_its_tensors_is_refused_before_any_model_is_built(good, tmp_path):
    path = rewritten(good, str(tmp_path / "blocks.gguf"), {"llama.block_count": (10**7, V.UINT32)})
    result = in_child(path, tmp_path)
    assert not result["ok"] and result["s"] < 30, result
    for part in ("blocks.gguf", "'llama.block_count' is 10000000", "tensors for 1 block(s), none named blk.1"):
        assert part in result["error"], (part, result)


def test_a_huge_context_costs_no_memory_outside_the_kv_budget(good, tmp_path):
    """context_length 2^24 (the server's default max_length): an Engine with a 64 MiB KV budget installs in little
    memory (the rotary tables were built for every position: 12 GB) and still generates."""
    path = rewritten(good, str(tmp_path / "long.gguf"), {"llama.context_length": (2**24, V.UINT32)})
    result = in_child(path, tmp_path, "engine")
    assert result["ok"] and result["tokens"], result
    assert result["grew"] < 400 << 20, result


@pytest.mark.parametrize("value", [2**62, 2**31])
def test_a_context_past_int32_is_refused_naming_the_key(good, tmp_path, value):
    path = rewritten(good, str(tmp_path / "ctx.gguf"), {"llama.context_length": (value, V.UINT64)})
    refused(path, f"'llama.context_length' is {value}", "not an integer in [1, 2147483647]")


def test_rotary_tables_fit_to_the_positions_used_are_the_full_tables_rows():
    """fit(n) builds rows 0..n-1 in chunks; each row equals the one-shot table's (cos / sin of p * inv_freq)."""
    rope = RotaryEmbedding(8, 40_000, 10000.0, None, rotary_dim=6)
    rope.fit(20_000)
    assert rope.cos.shape == (20_000, 8)
    inv_freq, _ = rope_frequencies(6, 10000.0, None)
    freqs = torch.arange(40_000, dtype=torch.float32)[:, None] * inv_freq[None, :]
    want_cos, want_sin = torch.ones(40_000, 8), torch.zeros(40_000, 8)
    for start in (0, 4):
        want_cos[:, start:start + 3], want_sin[:, start:start + 3] = freqs.cos(), freqs.sin()
    assert torch.equal(rope.cos, want_cos[:20_000]) and torch.equal(rope.sin, want_sin[:20_000])
    unfitted = RotaryEmbedding(8, 40_000, 10000.0, None, rotary_dim=6)      # never fitted: every position
    assert torch.equal(unfitted.cos, want_cos) and torch.equal(unfitted.sin, want_sin)


# ---- smaller ones: each a clear error naming file and key ---------------------------------------------------
@pytest.mark.parametrize("key, value, want", [
    ("llama.attention.head_count", (-4, V.INT32), "'llama.attention.head_count' is -4, not an integer in [1, "),
    ("llama.embedding_length", ([32, 32], V.ARRAY, V.UINT32), "'llama.embedding_length' is [32, 32], not an integer"),
    ("llama.embedding_length", (48, V.UINT32), "token_embd.weight has shape [512, 64], not [vocab, 48]"),
    ("llama.attention.layer_norm_rms_epsilon", (float("nan"), V.FLOAT32),
     "'llama.attention.layer_norm_rms_epsilon' is nan, not a finite number"),
    ("llama.rope.freq_base", (float("inf"), V.FLOAT32), "'llama.rope.freq_base' is inf, not a finite number above 0"),
    ("tokenizer.ggml.eos_token_id", (10**9, V.UINT32),
     "'tokenizer.ggml.eos_token_id' is 1000000000, not a token id of the vocabulary [0, 512)"),
    ("general.sampling.temp", (1e9, V.FLOAT32), "'general.sampling.temp' is 1000000000.0, not a valid default "
                                                "temperature (temperature must be in [0.0, 100.0]"),
    ("general.sampling.temp", ("hot", V.STRING), "'general.sampling.temp' is 'hot', not a valid default temperature"),
    ("general.sampling.top_p", (0.0, V.FLOAT32), "'general.sampling.top_p' is 0.0, not a valid default top_p"),
    ("general.sampling.top_k", (-1, V.INT32), "'general.sampling.top_k' is -1, not a valid default top_k"),
], ids=["negative_heads", "embedding_as_array", "embedding_vs_tensor", "nan_rms_eps", "inf_rope_base",
        "eos_outside_vocab", "temp_1e9", "temp_hot", "top_p_0", "top_k_negative"])
def test_a_bad_value_is_refused_naming_its_key(good, tmp_path, key, value, want):
    refused(rewritten(good, str(tmp_path / "bad.gguf"), {key: value}), want)


def test_good_sampling_defaults_load(good, tmp_path):
    path = rewritten(good, str(tmp_path / "sampling.gguf"), {"general.sampling.temp": (0.5, V.FLOAT32),
                                                              "general.sampling.top_k": (40, V.INT32)})
    gen = HuggingFaceModel(path, "ok").hf_generation_config
    assert (gen["temperature"], gen["top_k"], gen["do_sample"]) == (0.5, 40, True)


@pytest.mark.parametrize("key", ["general.architecture", "tokenizer.chat_template"])
def test_a_string_that_is_not_utf8_is_refused_naming_its_key(good, tmp_path, key):
    value = "llama" if key == "general.architecture" else "{{ messages[0]['content'] }}"

    def edit(data):
        at = data.index(gguf_string(key.encode()) + struct.pack("<I", V.STRING)) + 8 + len(key) + 4 + 8
        assert bytes(data[at:at + len(value)]) == value.encode()
        data[at + 1] = 0xFF                                  # no UTF-8 sequence starts with 0xff
    refused(patched(good, str(tmp_path / "utf8.gguf"), edit), f"metadata {key!r} is not valid UTF-8")


def test_misaligned_tensor_data_is_refused(good, tmp_path):
    def edit(data):
        at = tensor_info_at(bytes(data), "blk.0.attn_v.weight") + 4
        offset = struct.unpack_from("<Q", data, at)[0]
        data[at:at + 8] = struct.pack("<Q", offset + 4)
    refused(patched(good, str(tmp_path / "misaligned.gguf"), edit), "'blk.0.attn_v.weight' starts at data offset",
            "not a multiple of the alignment 32")


def test_overlapping_tensor_data_is_refused(good, tmp_path):
    """attn_v's data moved onto attn_k's (same shape, both aligned): two tensors reading the same bytes."""
    def edit(data):
        k, v = (tensor_info_at(bytes(data), f"blk.0.attn_{p}.weight") + 4 for p in "kv")
        data[v:v + 8] = data[k:k + 8]
    message = refused(patched(good, str(tmp_path / "overlap.gguf"), edit), "overlap")
    assert "'blk.0.attn_k.weight'" in message and "'blk.0.attn_v.weight'" in message
