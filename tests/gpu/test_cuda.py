"""GPU ranks: `compute_unit(TargetDevice.CUDA, ids)` through the Engine.

Without a GPU: a CUDA compute unit is refused at install with ALLSPARK_PARAM_ERROR naming it, and the engine
keeps serving. With one (marker `gpu`, skipped elsewhere): greedy output on the GPU equals transformers' and
the CPU engine's, alone and batched (teacher-forced logits are in test_hf_parity.py's `cuda` rows).
"""
from __future__ import annotations

import json
import threading

import pytest
import torch
from helpers import greedy, hf_greedy, random_prompt, run_together, serialize, start_engine

from allspark_client import settings
from allspark_client.types import AsException, AsStatus, TargetDevice
from allspark_server import Engine, HuggingFaceModel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def cuda_engine(loader, name: str, max_batch: int = 4, kv_bytes: int = 0, host_tier_bytes: int = 0) -> Engine:
    engine = Engine()
    b = (loader.create_reference_runtime_config_builder(name, TargetDevice.CUDA, [0], max_batch=max_batch)
         .max_length(256).kv_cache_span_size(16))
    if kv_bytes:
        b.kv_cache_memory(kv_bytes)
    if host_tier_bytes:
        b.prefix_cache_host_memory(host_tier_bytes)
    cfg = b.build()
    engine.install_model(cfg)
    engine.start_model(name)
    return engine


def assert_greedy_alone_and_batched(engine, name: str, hf_model, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy output equals transformers' for the first prompt alone, then for all of them submitted together."""
    expected = [hf_greedy(hf_model, p, new_tokens) for p in prompts]
    assert greedy(engine, name, torch.tensor([prompts[0]]), new_tokens) == expected[0]
    results = [None] * len(prompts)

    def run(i):
        results[i] = greedy(engine, name, torch.tensor([prompts[i]]), new_tokens)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backend_decode_steps_equal_the_reference(dtype):
    """The CUDA backend's norm, attention and MLP steps (its ops composed, Triton attention) against the reference
    steps, on the GPU where there is one, else on CPU tensors through the Triton interpreter."""
    pytest.importorskip("triton")
    from allspark_server.compute import ops, reference, steps
    cuda_ops = ops.cuda_backend()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)
    b, hidden, heads, kvh, d, inter, span, spans = 3, 64, 4, 2, 16, 96, 16, 12
    x, residual = rnd(b, hidden, scale=1.0), rnd(b, hidden, scale=1.0)
    norm = rnd(hidden, scale=1.0) + 1
    qkv_w, o_w = rnd((heads + 2 * kvh) * d, hidden), rnd(hidden, heads * d)
    gu_w, down_w = rnd(2 * inter, hidden), rnd(hidden, inter)
    angle = torch.rand(b, 1, d, generator=g)
    cos, sin = angle.cos().to(dev, dtype), angle.sin().to(dev, dtype)
    k_cache, v_cache = rnd(spans, span, kvh, d, scale=1.0), rnd(spans, span, kvh, d, scale=1.0)
    ctx = torch.tensor([5, 16, 33], device=dev)
    table = torch.tensor([[7, 0, 0], [3, 0, 0], [1, 9, 4]], device=dev)
    slots = torch.stack([table[i, (ctx[i] - 1) // span] * span + (ctx[i] - 1) % span for i in range(b)])
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    attention = [steps.BoundAttention(steps.Attention(scale=d ** -0.5), qkv_w, None, o_w, heads, kvh, k, v)
                 for k, v in caches]
    mlp = steps.BoundMlp(steps.Mlp(), gu_w, None, down_w)
    h_ref, s_ref = reference.rms_norm_reference(x, norm, 1e-6, residual)
    o_ref = reference.attention_step_reference(h_ref, attention[0], slots, table, ctx, cos, sin)
    h, s = cuda_ops.rms_norm(x, norm, 1e-6, residual)
    o = cuda_ops.attention_step(h, attention[1], slots, table, ctx, cos, sin)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches[1][0], caches[0][0])   # the new K/V rows went to their slots
    torch.testing.assert_close(caches[1][1], caches[0][1])
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(o.float(), o_ref.float(), **tol)
    h2_ref, s2_ref = reference.rms_norm_reference(o_ref, norm, 1e-6, s_ref)
    out_ref = reference.mlp_step_reference(h2_ref, mlp)
    h2, s2 = cuda_ops.rms_norm(o_ref, norm, 1e-6, s_ref)
    out = cuda_ops.mlp_step(h2, mlp)
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    torch.testing.assert_close(s2, s2_ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_unit_without_a_gpu_is_a_param_error_and_the_engine_serves_on(llama, tmp_path):
    loader = serialize(llama.hf_dir, "m", str(tmp_path))
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("m", TargetDevice.CUDA, [0], max_batch=2)
           .max_length(128).build())
    assert cfg.compute_unit == "CUDA:0"
    with pytest.raises(AsException) as err:
        engine.install_model(cfg)
    assert err.value.status == AsStatus.ALLSPARK_PARAM_ERROR
    assert "compute_unit CUDA:0" in str(err.value) and "no CUDA device" in str(err.value)
    start_engine(loader, "m", engine=engine)   # the same name, now on the CPU: nothing was left half-installed
    prompt = random_prompt(12, seed=4)
    assert greedy(engine, "m", torch.tensor([prompt]), 8) == hf_greedy(llama.model, prompt, 8)


@pytest.mark.gpu
@needs_gpu
def test_greedy_on_the_gpu_equals_transformers_alone_and_batched(llama, tmp_path):
    loader = serialize(llama.hf_dir, "g", str(tmp_path))
    engine = cuda_engine(loader, "g")
    assert_greedy_alone_and_batched(engine, "g", llama.model, [random_prompt(n, seed=20 + n) for n in (5, 17, 40)], 24)
    assert json.loads(engine.get_model_info("g"))["device"] == "cuda:0"


@pytest.mark.gpu
@needs_gpu
def test_graph_replay_equals_the_eager_step(llama, tmp_path):
    """Decode steps replayed from their CUDA graphs (inputs written from the runner's mirrors, padded up the
    ladder for 3 rows, then fewer rows than before, then more) give the eager step's logits; each step rewrites
    the same cache slots with the same values, so both see one cache, and a padding row left over from a larger
    step would write into a sequence's slots and show."""
    from test_hf_parity import runner_for

    from allspark_server.core.messages import ScheduledChunk
    from allspark_server.step.inputs import RequestMirror, build_forward_inputs
    loader = serialize(llama.hf_dir, "r", str(tmp_path))
    runner = runner_for(loader, "r", device="cuda", max_batch=4)
    assert runner.graphs is not None and 4 in runner.graphs.sizes
    per_seq = 16 // runner.span_size + 2
    for i in range(4):   # each sequence's 16-token prompt, prefilled eagerly
        spans = list(range(i * per_seq, (i + 1) * per_seq))
        runner.mirrors[i] = RequestMirror(random_prompt(16, seed=i) + [7 + i], spans, 0)
        inputs = build_forward_inputs([ScheduledChunk(i, 16, False)], runner.mirrors, runner.span_size)
        runner.model(inputs.to(runner.device), runner.kv)
        runner.mirrors[i].num_computed_tokens = 16
    for batch in (3, 1, 4, 2):
        chunks = [ScheduledChunk(i, 1, True) for i in range(batch)]
        assert runner.graphs.fits_decode(chunks)
        replayed = runner.graphs.run_decode(chunks, runner.mirrors).clone()
        eager = runner.model(build_forward_inputs(chunks, runner.mirrors, runner.span_size).to(runner.device),
                             runner.kv)
        assert replayed.shape == eager.shape == (batch, 512)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_graphs_with_programmatic_dependent_launch_equal_graphs_without(llama, tmp_path):
    """The decode graphs whose Triton kernels start before the kernel ahead of them ends (PDL, cuda/pdl.py: on
    by default on sm_90) give the same logits bit for bit, replay after replay, as graphs captured again with
    ALLSPARK_PDL=0: a kernel touching an activation before its wait would race and show as differing bits."""
    from test_hf_parity import runner_for

    from allspark_server.compute.cuda import pdl
    from allspark_server.core.messages import ScheduledChunk
    from allspark_server.runner.cuda_graphs import DecodeGraphs
    from allspark_server.step.inputs import RequestMirror, build_forward_inputs
    loader = serialize(llama.hf_dir, "p", str(tmp_path))
    runner = runner_for(loader, "p", device="cuda", max_batch=4)
    with_pdl = runner.graphs
    with settings.override(PDL=False):
        assert not pdl.enabled(runner.device)
        without = DecodeGraphs(runner.model, runner.kv, max(with_pdl.sizes), with_pdl.spans.shape[1],
                               with_pdl.scratch_span, with_pdl.span_size, with_pdl.spans.device)
    per_seq = 40 // runner.span_size + 2
    for i in range(4):
        runner.mirrors[i] = RequestMirror(random_prompt(40, seed=30 + i) + [5 + i], list(range(i * per_seq,
                                                                                               (i + 1) * per_seq)), 0)
        inputs = build_forward_inputs([ScheduledChunk(i, 40, False)], runner.mirrors, runner.span_size)
        runner.model(inputs.to(runner.device), runner.kv)
        runner.mirrors[i].num_computed_tokens = 40
    for batch in (1, 2, 4):
        chunks = [ScheduledChunk(i, 1, True) for i in range(batch)]
        reference = without.run_decode(chunks, runner.mirrors).clone()
        for _ in range(20):
            assert torch.equal(with_pdl.run_decode(chunks, runner.mirrors), reference)
    print(f"PDL on this GPU: {pdl.enabled(runner.device)}")


@pytest.mark.gpu
@needs_gpu
def test_overlapped_decode_steps_equal_one_step_at_a_time(llama, tmp_path):
    """Decode steps launched from the previous step's sampled ids on the GPU, before the host has read them (the
    default on one GPU), give the tokens and logprobs of the same engine stepping one step at a time, for
    penalties, seeded draws and logprobs; a stop token ends its request exactly; greedy equals transformers."""
    from test_overlap import SAMPLING_REQUESTS, assert_same_outputs

    from allspark_server.engine.step_loops import OverlappedLoop, SerialLoop
    loader = serialize(llama.hf_dir, "o", str(tmp_path))
    engine = cuda_engine(loader, "o")
    served = engine._models["o"]
    assert isinstance(served.loop, OverlappedLoop)
    prompt = random_prompt(7, 11)
    ref = hf_greedy(llama.model, prompt, 20)
    k = next(i for i in range(6, 20) if ref[i] not in ref[:i])
    stop = (prompt, {"top_k": 1, "max_new_tokens": 20, "eos_token_id": [ref[k]]})
    ahead = []
    original = served.scheduler.continue_decodes
    served.scheduler.continue_decodes = lambda plan: ahead.append(original(plan)) or ahead[-1]
    ours = run_together(engine, "o", SAMPLING_REQUESTS + [stop])
    assert any(ahead)
    served.loop = SerialLoop()
    theirs = run_together(engine, "o", SAMPLING_REQUESTS + [stop])
    assert ours[-1][0] == theirs[-1][0] == ref[:k + 1]
    assert_same_outputs(ours[:-1], theirs[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_two_gpu_pool_equals_transformers(llama, tmp_path, monkeypatch, overlap):
    """A 2-rank pool (mpirun), one GPU per rank, NCCL for the activations: greedy equals transformers, alone and
    batched, with the decode graphs (NCCL inside) replayed, stepping one step at a time and with overlapped
    scheduling (the worker's input ids broadcast from rank 0's GPU)."""
    from allspark_client import ClientEngine
    monkeypatch.setenv("ALLSPARK_OVERLAP", overlap)   # the ranks inherit mpirun's environment
    loader = serialize(llama.hf_dir, "p", str(tmp_path))
    client = ClientEngine(ranks=2)
    try:
        cfg = (loader.create_reference_runtime_config_builder("p", TargetDevice.CUDA, [0, 1], max_batch=4)
               .max_length(256).kv_cache_span_size(16).build())
        client.install_model(cfg)
        client.start_model("p")
        assert json.loads(client.get_model_info("p"))["world_size"] == 2
        assert_greedy_alone_and_batched(client, "p", llama.model, [random_prompt(n, seed=40 + n) for n in (6, 23)], 20)
    finally:
        client.close()


@pytest.mark.gpu
@needs_gpu
def test_prefix_cache_host_tier_and_guided_output_on_the_gpu(llama, tmp_path):
    """Cache hits, evictions to the pinned host tier and loads back keep the GPU's greedy tokens equal to
    transformers'; guided output on the GPU equals the CPU Engine's and validates."""
    import jsonschema
    from json_schemas import SCHEMAS

    from allspark_server.step.kv_cache import bytes_per_span
    loader = serialize(llama.hf_dir, "pc", str(tmp_path))
    a = loader.args
    per_span = bytes_per_span(a.num_layers, 16, a.num_kv_heads, a.head_dim, loader.data_type)
    engine = cuda_engine(loader, "pc", max_batch=1, kv_bytes=8 * per_span, host_tier_bytes=32 * per_span)
    system = random_prompt(64, seed=3)
    prompts = [system + random_prompt(5 + i, seed=30 + i) for i in range(4)]
    expected = [hf_greedy(llama.model, p, 20) for p in prompts]
    for rnd in range(2):   # 8 spans hold one request: the others' prefixes go to the host tier and come back
        assert [greedy(engine, "pc", p, 20) for p in prompts] == expected, rnd
    stat = engine.get_as_engine_stat("pc")
    assert stat.prefix_cache_hit_token >= 7 * 64 and stat.prefix_cache_host_spans > 0
    cpu = start_engine(loader, "pc_cpu", max_batch=1, max_length=256)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(llama.hf_dir)
    for name in ("person", "order"):
        schema = dict(SCHEMAS)[name]
        gen = {"response_format": {"type": "json_schema", "json_schema": schema}, "top_k": 1, "max_new_tokens": 200}
        from helpers import generate
        got, _ = generate(engine, "pc", random_prompt(9, seed=1), gen)
        want, _ = generate(cpu, "pc_cpu", random_prompt(9, seed=1), gen)
        assert got == want
        jsonschema.validate(json.loads(tok.decode(got, skip_special_tokens=True)), schema)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt,group,compute", [("int8", -1, "weight_only"), ("int4", 64, "weight_only"),
                                               ("uint4", 32, "weight_only"), ("int8", -1, "activate_quant"),
                                               ("fp8_e4m3", -1, "weight_only"), ("fp8_e4m3", 32, "weight_only"),
                                               ("fp8_e4m3", -1, "activate_quant")])
def test_quantized_weights_on_the_gpu_equal_transformers_on_the_stored_codes(llama, tmp_path, fmt, group, compute):
    """InstantQuant weights on a GPU rank (the Triton matmul over the codes, in the decode graphs and in
    prefill): greedy equals transformers running the stored codes dequantized independently, alone and batched
    (activate_quant: with every quantized projection's input rounded to int8 per token there too)."""
    from test_quant_models import hf_with_stored_weights, round_inputs_to_fp8, round_inputs_to_int8, serialize_quantized
    name = f"gq_{fmt}_{group}_{compute}"
    loader = serialize_quantized(llama.hf_dir, name, str(tmp_path),
                                 {"weight_format": fmt, "group_size": group, "compute_method": compute})
    reference = hf_with_stored_weights(llama.model, loader, fmt, group)
    if compute == "activate_quant":
        reference = (round_inputs_to_fp8 if fmt == "fp8_e4m3" else round_inputs_to_int8)(reference)
    engine = cuda_engine(loader, name)
    assert engine._engine.models[name].runner.graphs is not None
    assert_greedy_alone_and_batched(engine, name, reference, [random_prompt(n, seed=50 + n) for n in (5, 40, 130)], 24)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("layout,method", [("block", "fp8"), ("channel", "compressed-tensors")])
def test_published_fp8_checkpoints_on_the_gpu_equal_transformers_on_their_weights(llama, tmp_path, layout, method):
    """An FP8 checkpoint as published (written by test_fp8_checkpoints' packer: block scales or one a row) served
    with its codes as they are: greedy equals transformers running the weights the checkpoint stands for."""
    from test_fp8_checkpoints import write_fp8_folder
    folder = str(tmp_path / "fp8")
    reference, _ = write_fp8_folder(llama, folder, layout, method)
    name = f"gfp8_{layout}"
    loader = HuggingFaceModel(folder, name, user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    engine = cuda_engine(loader, name)
    assert_greedy_alone_and_batched(engine, name, reference, [random_prompt(n, seed=60 + n) for n in (5, 40, 130)], 24)


@pytest.mark.gpu
@needs_gpu
def test_quantized_kv_spans_on_the_gpu(llama, tmp_path):
    """int8 KV spans on a GPU rank (Triton decode attention over the codes, inside the graphs): greedy equals
    transformers' on the fp32 tiny model (as the CPU's int8 KV test), alone and batched; uint4's and fp8's logprobs
    stay within the CPU uint4 test's bound of transformers'."""
    loader = serialize(llama.hf_dir, "gkv", str(tmp_path))
    engines = {}
    for mode in ("int8", "uint4", "fp8"):
        engine = Engine()
        cfg = (loader.create_reference_runtime_config_builder(f"gkv_{mode}", TargetDevice.CUDA, [0], max_batch=4)
               .max_length(256).kv_cache_span_size(16).kv_cache_mode(mode).build())
        engine.install_model(cfg)
        engine.start_model(f"gkv_{mode}")
        assert engine._engine.models[f"gkv_{mode}"].runner.graphs is not None
        engines[mode] = engine
    prompts = [random_prompt(n, seed=seed) for seed, n in ((1, 5), (2, 40), (3, 130))]   # the CPU test's: tie-free
    assert_greedy_alone_and_batched(engines["int8"], "gkv_int8", llama.model, prompts, 24)
    from test_kv_quant import assert_logprobs_close_to_transformers
    assert_logprobs_close_to_transformers(engines["uint4"], "gkv_uint4", llama.model)
    assert_logprobs_close_to_transformers(engines["fp8"], "gkv_fp8", llama.model)
