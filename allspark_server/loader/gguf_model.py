"""A GGUF model as HuggingFaceModel reads it: its config, generation defaults, tokenizer and the decoder's tensors.

Formats: each GEMM weight (and the LM head) is kept in the exact mapping of its block type, or requantized to the
format `gguf_requant` chooses (gguf_tensors.py). The parts of a fused projection (q/k/v, gate/up) must share one
format: the odd parts are requantized to the majority format (ties: the more precise), and that is logged.
Every other tensor (embedding, norms, experts, routers) is dequantized exactly and cast into the model's dtype.
A tied head (no output.weight) over a Q8_0 / Q4_0 / Q4_1 embedding keeps the embedding's own codes: a quantized
head, an exact copy of the file's. The quantized weights' formats travel in the scheme (QuantScheme.formats).
Gemma's norms arrive as 1 + weight (llama.cpp's converter adds 1), which is what our Gemma decoder holds.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
import tempfile
from collections import Counter, defaultdict
from typing import Callable, Optional

import torch

from allspark_server.loader import gguf_tensors as gt
from allspark_server.loader.gguf_config import generation_config, hf_config
from allspark_server.loader.gguf_names import permuted, targets, unpermute
from allspark_server.loader.gguf_reader import ARRAY, MAGIC, MAX_VALUES, GGUFError, GGUFFile, GGUFTensor
from allspark_server.loader.weights import checkpoint_shapes, checkpoint_weight_names, quantize_layers
from allspark_server.models.args import ModelArgs
from allspark_server.models.decoder import quantizable_weights
from allspark_server.quant.formats import bits
from allspark_server.quant.scheme import LM_HEAD, QuantConfigError, QuantScheme

log = logging.getLogger("allspark")
DENSE = "dense"
PRECISION = (DENSE, "int8", "uint8", "uint4_min", "uint4", "int4")   # fused-part ties go to the earlier one


class GGUFModel:
    """`path`: a .gguf file; `requant`: our format for the block types without an exact mapping (one format
    name, a dict {GGML type name: format}, or None: int8 for Q5*/Q6_K, uint4_min for the rest)."""

    def __init__(self, path: str, requant=None):
        self.path = path
        self.file: Optional[GGUFFile] = GGUFFile(path)     # memory-mapped until load() is done with it
        self.architecture = self.file.architecture
        self.requant = requant
        self.hf_config = hf_config(self.file)
        self.generation_config = generation_config(self.file, self.hf_config["vocab_size"])
        self.requant_errors: dict[str, float] = {}    # "<gguf part> <type> -> <format>": relative error
        try:
            for t in self.file.tensors.values():
                gt.check_servable(t)
                if not gt.is_dense(t.type) and gt.exact_format(t.type) is None:
                    gt.requant_format(t.type, requant)    # a bad gguf_requant fails here, before any work
        except GGUFError as e:
            raise GGUFError(f"{path!r}: {e}") from None

    # ---- tensors -------------------------------------------------------------------------------
    def load(self, args: ModelArgs, meta_model: Callable, dtype: torch.dtype
             ) -> tuple[dict[str, torch.Tensor], Optional[QuantScheme]]:
        """The decoder's tensors (quantized weights as `<base>.qweight/.scales[/.mins]`) and their scheme
        (None: nothing quantized). `meta_model()` builds the model on the meta device. The file is unmapped
        afterwards (the tensors are copies; its pages would stay resident while this object lives)."""
        if self.file is None:
            self.file = GGUFFile(self.path)
        try:
            return self._load(args, meta_model, dtype)
        finally:
            self.file = None

    def _load(self, args: ModelArgs, meta_model: Callable, dtype: torch.dtype
              ) -> tuple[dict[str, torch.Tensor], Optional[QuantScheme]]:
        shapes = checkpoint_shapes(meta_model())
        sources = self._sources(args, shapes)
        plan = self._formats(sources, shapes, meta_model, args)
        tensors: dict[str, torch.Tensor] = {}
        errors: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, (t, expert) in _progress(sorted(sources.items()), len(sources)):
            fmt = plan.get(name, DENSE)
            try:
                converted = self._convert(t, expert, name, fmt, args, shapes[name], errors)
            except GGUFError as e:
                raise GGUFError(f"{self.path!r}: {e}") from None
            if fmt == DENSE:
                tensors[name] = converted[DENSE].to(dtype)
            else:
                tensors.update({f"{name[:-len('.weight')]}.{p}": v for p, v in converted.items()})
        if args.tie_word_embeddings and "lm_head.weight" in plan:      # the head from the embedding's codes
            t, _ = sources["model.embed_tokens.weight"]
            tensors.update({f"lm_head.{p}": v for p, v in gt.exact_tensors(gt.raw_rows(t), t.type).items()})
        for key, (err, norm) in sorted(errors.items()):
            self.requant_errors[key] = (err / norm) ** 0.5 if norm else 0.0
            log.info("GGUF %s: requantized, relative error %.4f", key, self.requant_errors[key])
        if not plan:
            return tensors, None
        counts = Counter(plan.values())
        majority = max(counts, key=lambda f: (counts[f], -PRECISION.index(f)))
        scheme = QuantScheme(majority, gt.GROUP, groups={n: gt.GROUP for n in plan}, lm_head="lm_head.weight" in plan,
                             formats=dict(plan))
        return tensors, scheme

    def _sources(self, args: ModelArgs, shapes: dict) -> dict[str, tuple[GGUFTensor, Optional[int]]]:
        """decoder name -> (its GGUF tensor, expert index or None); every name the decoder needs, no other."""
        sources = {}
        for t in self.file.tensors.values():
            found = targets(t.name, self.architecture, args.num_experts)
            if found is None:
                raise GGUFError(f"{self.path!r}: unexpected tensor {t.name!r} for GGUF architecture "
                                f"{self.architecture!r}")
            for target in found:
                if target.name not in shapes:
                    raise GGUFError(f"{self.path!r}: tensor {t.name!r} (as {target.name!r}) is not part of this "
                                    f"{args.architecture} model")
                sources[target.name] = (t, target.expert)
        expected = set(shapes) - ({"lm_head.weight"} if args.tie_word_embeddings else set())
        missing = sorted(expected - set(sources))
        if missing:
            raise GGUFError(f"{self.path!r} lacks tensors for {args.architecture} (in the decoder's names): "
                            f"{missing[:5]}")
        return sources

    def _formats(self, sources: dict, shapes: dict, meta_model: Callable, args: ModelArgs) -> dict[str, str]:
        """decoder weight name -> our format, for every weight kept quantized."""
        quantizable = re.compile(quantizable_weights(args.architecture) + "|" + LM_HEAD)
        plan = {}
        for name, (t, _) in sources.items():
            if quantizable.search(name) and not gt.is_dense(t.type) and len(shapes[name]) == 2:
                plan[name] = self._format(t)
        embd, _ = sources["model.embed_tokens.weight"]
        if args.tie_word_embeddings and gt.exact_format(embd.type) and self._format(embd) == gt.exact_format(embd.type):
            plan["lm_head.weight"] = gt.exact_format(embd.type)
        for module, parts in checkpoint_weight_names(meta_model()).items():
            chosen = [plan.get(p, DENSE) for p in parts]
            if len(set(chosen)) < 2:
                continue
            counts = Counter(chosen)
            fmt = max(counts, key=lambda f: (counts[f], -PRECISION.index(f)))
            for part, was in zip(parts, chosen):
                if was != fmt:
                    log.info("GGUF: %s (%s) is requantized to %s, the format of the other parts of %s", part,
                             sources[part][0].type_name, fmt, module)
            for p in parts:
                if fmt == DENSE:
                    plan.pop(p, None)
                else:
                    plan[p] = fmt
        if plan:
            try:
                quantize_layers(meta_model(), QuantScheme("int8", gt.GROUP, groups={n: gt.GROUP for n in plan},
                                                          formats=dict(plan)))
            except QuantConfigError as e:
                raise GGUFError(f"{self.path!r}: {e}") from None
        return plan

    def _format(self, t: GGUFTensor) -> str:
        """Our format for a quantized GEMM weight: its exact mapping, else the requantization's."""
        return gt.exact_format(t.type) or gt.requant_format(t.type, self.requant)

    def _convert(self, t: GGUFTensor, expert: Optional[int], name: str, fmt: str, args: ModelArgs,
                 shape: tuple, errors: dict) -> dict[str, torch.Tensor]:
        """One decoder tensor: {DENSE: fp32 values} or our quantized parts."""
        if fmt != DENSE and fmt == gt.exact_format(t.type):
            parts = gt.exact_tensors(gt.raw_rows(t, expert), t.type)
            k = parts["qweight"].shape[1] * (2 if bits(fmt) == 4 else 1)
            if (parts["qweight"].shape[0], k) != tuple(shape):
                raise GGUFError(f"tensor {t.name!r} is {parts['qweight'].shape[0]} x {k}, the config implies {shape}")
        else:
            values = gt.dequantized(t, expert)
            if values.numel() != _numel(shape):
                raise GGUFError(f"tensor {t.name!r} has shape {tuple(values.shape)}, the config implies {shape}")
            values = values.reshape(shape)       # e.g. a [hidden] shared-expert gate stored for [1, hidden]
            if fmt == DENSE:
                parts = {DENSE: values}
            else:
                parts, err = gt.requantize(values, fmt)
                key = f"{t.name.split('.')[-2] if t.name.startswith('blk.') else t.name} {t.type_name} -> {fmt}"
                norm = float(values.double().pow(2).sum())
                errors[key][0] += err * err * norm
                errors[key][1] += norm
        if permuted(name, self.architecture):
            parts = {p: unpermute(v, args) for p, v in parts.items()}
        return parts


TOKENIZER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "gguf-tokenizers")


def load_gguf_tokenizer(path: str, **kwargs):
    """transformers' fast tokenizer built from the file's metadata (vocab, merges, special tokens, chat
    template). Building it takes seconds (every server start asks for it), so it is kept once built, saved by
    transformers under ~/.cache/allspark/gguf-tokenizers, keyed by the file's path, size and mtime.
    transformers reads every metadata key of the file it is given: it is given `tokenizer_file`'s copy of the
    keys a tokenizer needs, so that what the file holds besides costs nothing here either."""
    from transformers import AutoTokenizer
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(TOKENIZER_CACHE, key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached, **kwargs)
        except Exception as e:     # a damaged cache entry: build it again
            log.warning("GGUF tokenizer cache %s unreadable (%s): rebuilding it", cached, e)
    with tempfile.TemporaryDirectory(prefix="allspark-gguf-tokenizer.") as folder:
        name = os.path.basename(path)
        tokenizer_file(path, os.path.join(folder, name))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=key + ".", dir=_makedirs(TOKENIZER_CACHE))
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)         # atomic: a concurrent reader sees a whole entry or none
    except OSError as e:                # a read-only home, or another process won the race: not an error
        log.info("GGUF tokenizer not cached (%s)", e)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def tokenizer_file(path: str, out: str) -> None:
    """Write to `out` a GGUF file of `path`'s metadata that a tokenizer reads (general.architecture and .name,
    tokenizer.* and <architecture>.*, each record copied as it is) and no tensors. Arrays of arrays are left
    out (transformers reads none); an array longer than the reader's MAX_VALUES is refused, naming its key."""
    f = GGUFFile(path)
    keys = []
    for k in f.fields:
        if k not in ("general.architecture", "general.name") and not k.startswith(("tokenizer.",
                                                                                  f"{f.architecture}.")):
            continue
        info = f.array_info(k)
        if info is not None and info[1] > MAX_VALUES:
            raise GGUFError(f"{path!r}: metadata {k!r} is an array of {info[1]} values, more than the {MAX_VALUES} "
                            f"allspark reads from one key")
        if info is None or info[0] != ARRAY:
            keys.append(k)
    with open(out, "wb") as w:
        w.write(MAGIC + struct.pack("<IQQ", 3, 0, len(keys)))
        w.write(f.metadata_bytes(keys))


def _makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _progress(items, total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc="GGUF", unit="tensor", disable=None)
