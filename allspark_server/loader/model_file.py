"""allspark model files: `<name>.asgraph` (a ModelGraph protobuf) + `<name>.asparam` (safetensors).

Tensors are written whole with their split mode recorded; a rank reads only the slices it needs
(loader/rank_weights.py), so it never holds the full model. Tied LM heads are not stored: they are
read from the embedding.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from allspark_client._proto import allspark_pb2 as pb
from allspark_client.version import __version__
from allspark_server.build_info import git_info
from allspark_server.layers.sharding import SplitMode
from allspark_server.models.args import ModelArgs
from allspark_server.quant.scheme import QuantScheme

FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}   # a model's dtype
STORAGE_DTYPES = {**DTYPES, "int8": torch.int8, "uint8": torch.uint8}                      # a tensor's
HASH_BYTES = 32 << 20


class ModelFileError(ValueError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in STORAGE_DTYPES.items():
        if d == dtype:
            return name
    raise ModelFileError(f"unsupported dtype {dtype}")


def _md5_head(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        h.update(f.read(HASH_BYTES))
    return h.hexdigest()


def write_model_files(out_dir: str, model_name: str, args: ModelArgs, hf_config: dict, dtype: torch.dtype,
                      tensors: dict[str, torch.Tensor], split_modes: dict[str, SplitMode],
                      eos_ids: list[int], stop_ids: list[int], serialize_args: dict[str, str],
                      quant: QuantScheme | None = None, tokenizer_json: str = "",
                      paths: tuple[str, str] | None = None,
                      side_tensors: dict[str, torch.Tensor] | None = None) -> tuple[str, str]:
    """Write `<out_dir>/<name>.asgraph` + `.asparam`, or the (graph, param) `paths` given. `side_tensors` (a vision
    tower's) go into the .asparam under their own names, outside the graph: ranks never load them."""
    from safetensors.torch import save_file

    safe = model_name.replace("/", "_")
    graph_path, param_path = paths or (os.path.join(out_dir, safe + ".asgraph"),
                                       os.path.join(out_dir, safe + ".asparam"))
    for folder in {os.path.dirname(graph_path), os.path.dirname(param_path)}:
        os.makedirs(folder or ".", exist_ok=True)
    # both files are written under temporary names and renamed at the end: a failure leaves no half-written model
    param_tmp, graph_tmp = param_path + ".tmp", graph_path + ".tmp"
    try:   # the version that wrote the weights, for get_file_information (DashInfer's create_version_param)
        clash = set(side_tensors or ()) & set(tensors)
        if clash:
            raise ModelFileError(f"side tensors named as the decoder's: {sorted(clash)[:3]}")
        save_file({k: v.contiguous() for k, v in {**tensors, **(side_tensors or {})}.items()}, param_tmp,
                  metadata={"format": "allspark", "allspark_version": __version__})
        _write_graph(graph_tmp, param_tmp, model_name, args, hf_config, dtype, tensors, split_modes, eos_ids,
                     stop_ids, serialize_args, quant, tokenizer_json)
        os.replace(param_tmp, param_path)
        os.replace(graph_tmp, graph_path)
    except BaseException:
        for tmp in (param_tmp, graph_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    return graph_path, param_path


def _write_graph(path: str, param_path: str, model_name: str, args: ModelArgs, hf_config: dict,
                 dtype: torch.dtype, tensors: dict[str, torch.Tensor], split_modes: dict[str, SplitMode],
                 eos_ids: list[int], stop_ids: list[int], serialize_args: dict[str, str],
                 quant: QuantScheme | None, tokenizer_json: str) -> None:
    g = pb.ModelGraph(format_version=FORMAT_VERSION, model_name=model_name, architecture=args.architecture,
                      model_args_json=json.dumps(args.to_dict()), hf_config_json=json.dumps(hf_config),
                      dtype=dtype_name(dtype), quantization=quant.to_json() if quant else "",
                      tokenizer_json=tokenizer_json)
    for name, t in tensors.items():
        g.tensors.add(name=name, shape=list(t.shape), dtype=dtype_name(t.dtype), split_mode=int(split_modes[name]))
    g.build_meta.allspark_version = __version__
    g.build_meta.git_sha = git_info()[0]
    g.build_meta.build_time = datetime.datetime.now(datetime.timezone.utc).isoformat()
    g.build_meta.weight_hash = _md5_head(param_path)
    g.build_meta.serialize_args.update(serialize_args)
    g.generation.eos_token_ids.extend(eos_ids)
    g.generation.stop_token_ids.extend(stop_ids)
    g.generation.context_length = args.max_position_embeddings
    with open(path, "wb") as f:
        f.write(g.SerializeToString())


@dataclass
class ModelFile:
    graph: "pb.ModelGraph"
    args: ModelArgs
    dtype: torch.dtype
    weights_path: str
    weights_size: int = -1          # the weights file's size when the graph was read (install): -1 unknown

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.graph.generation.eos_token_ids)

    @property
    def tokenizer_json(self) -> str:
        """The model folder's HF tokenizer as tokenizer.json text; "" if it had none (no guided output)."""
        return self.graph.tokenizer_json

    def side_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors stored beside the decoder's whose names start with `prefix` (write_model_files)."""
        from safetensors import safe_open
        listed = {t.name for t in self.graph.tensors}
        with safe_open(self.weights_path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix) and k not in listed}

    @property
    def quant(self) -> QuantScheme | None:
        """The InstantQuant scheme the weights were serialized with (None: not quantized)."""
        return QuantScheme.from_json(self.graph.quantization)


def read_model_graph(graph_path: str, weights_path: str) -> ModelFile:
    for p in (graph_path, weights_path):
        if not os.path.isfile(p):
            raise ModelFileError(f"model file {p!r} does not exist")
    g = pb.ModelGraph()
    try:
        with open(graph_path, "rb") as f:
            g.ParseFromString(f.read())
    except Exception as e:
        raise ModelFileError(f"{graph_path!r} is not an allspark .asgraph file: {e}") from None
    if g.format_version != FORMAT_VERSION:
        raise ModelFileError(f"{graph_path!r} has format version {g.format_version} (written by allspark "
                             f"{g.build_meta.allspark_version or '?'}); this allspark ({__version__}) reads format "
                             f"version {FORMAT_VERSION} (serialize the model again)")
    if g.dtype not in DTYPES:
        raise ModelFileError(f"{graph_path!r} has unknown dtype {g.dtype!r}")
    return ModelFile(g, ModelArgs.from_dict(json.loads(g.model_args_json)), DTYPES[g.dtype], weights_path,
                     os.path.getsize(weights_path))


def weights_changed(model_file: ModelFile) -> str | None:
    """None while the weights file is still the one the model was installed from; else what changed: it is gone,
    its size differs, or the md5 of its first 32 MiB differs from the one its graph records (build_meta.weight_hash,
    DashInfer's check)."""
    path = model_file.weights_path
    if not os.path.isfile(path):
        return f"the weights file {path!r} is gone"
    size = os.path.getsize(path)
    if model_file.weights_size >= 0 and size != model_file.weights_size:
        return f"the weights file {path!r} is {size} bytes, {model_file.weights_size} when the model was installed"
    recorded = model_file.graph.build_meta.weight_hash
    if recorded and _md5_head(path) != recorded:
        return (f"the weights file {path!r} changed since it was written: the md5 of its first {HASH_BYTES >> 20} "
                f"MiB differs from the weight_hash its .asgraph records")
    return None


def save_model_files(model_file: ModelFile, saved_dir: str, name: str, with_weight: bool) -> tuple[str, str | None]:
    """An installed model's files again (DashInfer's save_model): `<saved_dir>/<name>.asgraph`, the graph as it was
    installed, and with `with_weight` a copy of its .asparam, refused if that file changed since (its hash).
    Returns (graph, param or None)."""
    import shutil
    safe = name.replace("/", "_")
    graph_path, param_path = (os.path.join(saved_dir, safe + ext) for ext in (".asgraph", ".asparam"))
    os.makedirs(saved_dir, exist_ok=True)
    src = model_file.weights_path
    if with_weight:
        changed = weights_changed(model_file)
        if changed:
            raise ModelFileError(f"{changed}: the model was installed from it, so it cannot be saved again")
        if not (os.path.exists(param_path) and os.path.samefile(src, param_path)):
            shutil.copyfile(src, param_path + ".tmp")
            os.replace(param_path + ".tmp", param_path)
    with open(graph_path + ".tmp", "wb") as f:
        f.write(model_file.graph.SerializeToString())
    os.replace(graph_path + ".tmp", graph_path)
    return graph_path, param_path if with_weight else None
