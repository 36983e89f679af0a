"""The sampler's chain over a batch of rows of every kind, with either draw: greedy tokens, penalties and logprobs
against per-row references (transformers' processors, float64), top-k / top-p masks against transformers' warpers
and hand-worked ties, every row alone equal to the batch; the host's draws are each seeded generator's
torch.multinomial stream, the counter-based draws (a GPU's; here on CPU tensors) depend on the request alone and
follow the processed softmax. With a GPU (marker `gpu`): CUDA logits give the CPU tensors' results, and through the
Engine alone equals batched.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import hf_apply, presence_frequency_ref
from transformers import (
    MinLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from allspark_client.config import GenerationConfig
from allspark_server.runner.draws import draw_key, gumbel_draws, gumbel_noise, mix32, multinomial_draws
from allspark_server.runner.sampler import Sampler, SamplingState, apply_penalties_rows, mask_top_k_top_p

NEG_INF = float("-inf")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# chi-square critical values at a false-alarm probability of 1e-6 (scipy.stats.chi2.isf(1e-6, df)), by df
CHI2_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89}
SAMPLERS = {"host": Sampler("cpu"),                           # torch.multinomial with each request's generator
            "counter": Sampler("cpu", draw=gumbel_draws)}     # a GPU's draws, on CPU tensors
COUNTER = SAMPLERS["counter"]


def rand_logits(n: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def rows_of(cfgs: list[dict], histories: list[tuple[list[int], list[int]]]):
    return [(SamplingState.create(GenerationConfig(**c)), a, o) for c, (a, o) in zip(cfgs, histories)]


def mixed_batch(vocab: int, seed: int):
    """Logits and rows of every kind: greedy with penalties / min_length / guided-style -inf masks / logprobs,
    and seeded sampling rows with top-k / top-p / logprobs. Penalties and masks hit the raw favourites."""
    rng = random.Random(seed)
    n = 12
    logits = rand_logits(n, vocab, seed)
    cfgs, histories = [], []
    for i in range(n):
        order = torch.argsort(logits[i], descending=True).tolist()
        prompt = [order[1], rng.randrange(vocab), rng.randrange(vocab)]
        output = [order[2], order[2], rng.randrange(vocab)]
        greedy = rng.choice([dict(top_k=1), dict(do_sample=False), dict(temperature=0.0)]) if i % 3 else \
            dict(temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([0, 3, vocab - 1]),
                 top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.randrange(2**64))
        cfg = dict(greedy, repetition_penalty=rng.choice([1.0, 1.5, 0.8]), presence_penalty=rng.choice([0.0, 0.4]),
                   frequency_penalty=rng.choice([0.0, 0.3, -0.2]), logprobs=i % 2 == 0, top_logprobs=i % 4)
        if i % 4 == 1:   # min_length not reached: the raw favourite is an EOS and must not come out
            cfg.update(min_length=50, eos_token_ids=(order[0], order[3]))
        if i % 5 == 2:   # a guided-style mask: the favourites and a random third of the vocabulary disallowed
            logits[i, order[:2] + rng.sample(range(vocab), vocab // 3)] = NEG_INF
            logits[i, order[-1]] = 0.0   # at least one token stays allowed
        cfgs.append(cfg)
        histories.append((prompt + output, output))
    return logits, cfgs, histories


def processed_reference(x: torch.Tensor, gen: GenerationConfig, all_ids: list[int], output_ids: list[int]):
    """One row's penalties and min_length EOS mask from transformers' processors (+ float64 presence/frequency)."""
    s = x.clone()
    if gen.repetition_penalty != 1.0:
        s = hf_apply(RepetitionPenaltyLogitsProcessor(gen.repetition_penalty), all_ids, s)
    if gen.presence_penalty or gen.frequency_penalty:
        s = presence_frequency_ref(s, output_ids, gen.presence_penalty, gen.frequency_penalty).float()
    if gen.min_length and gen.eos_token_ids:
        s = hf_apply(MinLengthLogitsProcessor(gen.min_length, list(gen.eos_token_ids)), all_ids, s)
    return s


@pytest.mark.parametrize("vocab", [7, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("draw", sorted(SAMPLERS))
def test_batch_greedy_tokens_and_logprobs(vocab, seed, draw):
    """Every row of the batch gets what it gets alone; greedy rows the argmax of the reference-processed row, rows
    with logprobs those of their raw row."""
    logits, cfgs, histories = mixed_batch(vocab, seed)
    sampler = SAMPLERS[draw]
    batched = sampler.sample_rows(logits.clone(), rows_of(cfgs, histories))
    moved = 0
    for i, (all_ids, output_ids) in enumerate(histories):
        alone = sampler.sample_rows(logits[i:i + 1].clone(), rows_of([cfgs[i]], [histories[i]]))[0]
        assert (batched[i].token_id, batched[i].logprob, batched[i].top_logprobs) == \
            (alone.token_id, alone.logprob, alone.top_logprobs), i
        gen = GenerationConfig(**cfgs[i])
        if gen.is_greedy:
            assert batched[i].token_id == int(processed_reference(logits[i], gen, all_ids, output_ids).argmax()), i
            moved += batched[i].token_id != int(logits[i].argmax())
        if gen.logprobs:
            raw = torch.log_softmax(logits[i].double(), -1)
            assert batched[i].logprob == pytest.approx(float(raw[batched[i].token_id]), abs=1e-5)
            top = torch.topk(raw, gen.top_logprobs)
            assert [t for t, _ in batched[i].top_logprobs] == top.indices.tolist()
            assert [v for _, v in batched[i].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
        else:
            assert batched[i].logprob is None and batched[i].top_logprobs == []
    assert moved >= 2, "penalties / min_length should have moved some greedy rows off the raw argmax"


def test_the_device_picks_the_draw():
    assert Sampler("cpu").draw is multinomial_draws
    assert Sampler(torch.device("cuda", 0)).draw is gumbel_draws     # nothing touches the GPU before sampling


def test_penalties_hand_worked_and_rows_independent():
    x = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0],
                      [1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0],
                      [1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0]])
    rows = rows_of([dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                    dict(),   # no penalties: untouched although its ids are in the index
                    dict(repetition_penalty=0.5)],
                   [([0, 1, 2, 2, 3], [2, 2, 3]), ([0, 1, 6], [6]), ([6, 6, 1], [])])
    out = apply_penalties_rows(x.clone(), rows)
    # row 0: repetition over {0,1,2,3}: 0.5, -2, 1, 0.25; then token 2 (count 2): 1 - 0.5 - 0.5 = 0,
    # token 3 (count 1): 0.25 - 0.25 - 0.5 = -0.5.  row 2: penalty 0.5 over {1, 6}: -1 * 0.5, 3 / 0.5
    torch.testing.assert_close(out, torch.tensor([[0.5, -2.0, 0.0, -0.5, -0.5, 0.0, 3.0],
                                                  [1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0],
                                                  [1.0, -0.5, 2.0, 0.5, -0.5, 0.0, 6.0]]), rtol=0, atol=0)


@pytest.mark.parametrize("vocab", [7, 1000])
def test_penalties_match_references_and_rows_alone(vocab):
    logits, cfgs, histories = mixed_batch(vocab, 5)
    rows = rows_of(cfgs, histories)
    out = apply_penalties_rows(logits.clone(), rows)
    for i, (state, all_ids, output_ids) in enumerate(rows):
        assert torch.equal(out[i], apply_penalties_rows(logits[i:i + 1].clone(), [rows[i]])[0]), i
        ref = processed_reference(logits[i], GenerationConfig(**dict(cfgs[i], min_length=0)), all_ids, output_ids)
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [7, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_top_k_top_p_mask_matches_the_warpers(vocab, seed):
    rng = random.Random(seed)
    ks = [0, 1, 2, 5, vocab - 1, vocab, vocab + 3]
    ps = [1e-9, 0.01, 0.2, 0.5, 0.8, 0.95, 0.999, 1.0]   # 1e-9: (1 - p) rounds to 1, the favourite still stays
    n = 24
    x = rand_logits(n, vocab, seed, scale=rng.choice([0.5, 3.0]))
    x[3, : vocab // 2] = NEG_INF                                # a prior mask
    x[4] = 0.0                                                  # all tied: probabilities exactly 1/vocab
    k = [rng.choice(ks) for _ in range(n)]
    p = [rng.choice(ps) for _ in range(n)]
    x[5], x[5, :10] = NEG_INF, 0.0                              # ten tied: at p=0.9 the 1st cum (0.1f) is (1-p)
    k[4], p[4], k[5], p[5] = 0, 0.5, 0, 0.9
    for top_p in (p, [1.0] * n):                                # top_p on in some rows; top_k alone
        out = mask_top_k_top_p(x.clone(), k, top_p)
        for r in range(n):
            ref = hf_apply(TopKLogitsWarper(k[r]), [], x[r]) if k[r] else x[r]
            ref = hf_apply(TopPLogitsWarper(top_p[r]), [], ref) if top_p[r] < 1.0 else ref
            if r in (4, 5) and top_p[r] < 1.0:   # ties at the cut: as many kept as transformers keeps, the lowest ids
                kept = int((~torch.isneginf(ref)).sum())
                assert kept == {4: vocab // 2 + (vocab == 7), 5: min(vocab, 9)}[r]
                assert torch.nonzero(~torch.isneginf(out[r])).flatten().tolist() == list(range(kept))
            else:
                assert torch.equal(out[r], ref), (r, k[r], top_p[r])


@pytest.mark.parametrize("cfg", [dict(temperature=0.8), dict(temperature=1.3, top_k=20),
                                 dict(temperature=0.6, top_p=0.9), dict(temperature=1.1, top_k=40, top_p=0.8)])
def test_seeded_draws_are_the_generators_multinomial_stream(cfg):
    """A seeded request's tokens on the host are torch.multinomial of the processed softmax (built here from
    transformers' warpers) with a generator of its seed, step after step, whatever rows share its batches."""
    vocab, steps = 300, 30
    gen = GenerationConfig(seed=77, **cfg)
    state, other = SamplingState.create(gen), SamplingState.create(GenerationConfig(temperature=1.0, seed=5))
    reference = torch.Generator().manual_seed(77)
    sampler = Sampler("cpu")
    assert sampler.draw is multinomial_draws
    for step in range(steps):
        logits = torch.stack([rand_logits(1, vocab, 1000 + step)[0], rand_logits(1, vocab, 2000 + step)[0]])
        row = 1 if step % 2 else 0
        rows = [(state, [1], []), (other, [2], [])] if row == 0 else [(other, [2], []), (state, [1], [])]
        got = sampler.sample_rows(logits.clone(), rows)[row].token_id
        ref = hf_apply(TemperatureLogitsWarper(cfg["temperature"]), [], logits[row])
        ref = hf_apply(TopKLogitsWarper(cfg["top_k"]), [], ref) if cfg.get("top_k") else ref
        ref = hf_apply(TopPLogitsWarper(cfg["top_p"]), [], ref) if cfg.get("top_p") else ref
        probs = torch.softmax(ref, -1)
        assert got == int(torch.multinomial(probs, 1, generator=reference)), step


def test_hash_is_lowbias32():
    def reference(v: int) -> int:   # Python ints, as published
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)
    rng = random.Random(0)
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(2000)]
    assert mix32(torch.tensor(values)).tolist() == [reference(v) for v in values]


def test_noise_depends_on_key_and_token_only():
    keys = [draw_key(s, t) for s, t in [(0, 0), (0, 1), (1, 0), (2**64 - 1, 7)]]
    together = gumbel_noise(keys, 50, "cpu")
    for r, key in enumerate(keys):
        assert torch.equal(gumbel_noise([key], 50, "cpu")[0], together[r])
        assert torch.equal(gumbel_noise([key], 20, "cpu")[0], together[r, :20])   # not on the vocabulary size
    assert torch.isfinite(together).all()
    assert len({tuple(row.tolist()) for row in together}) == 4
    assert len(set(keys)) == 4 and draw_key(3, 0) == draw_key(3 + 2**64, 0)     # seeds are taken mod 2^64
    for bit in (0, 31, 32, 63):   # every bit of the 64-bit key moves the noise
        assert not torch.equal(gumbel_noise([keys[0] ^ (1 << bit)], 50, "cpu")[0], together[0])


def test_seeded_draws_depend_on_the_request_alone():
    vocab = 40
    logits, cfgs, histories = mixed_batch(vocab, 9)
    rows = rows_of(cfgs, histories)
    alone = [COUNTER.sample_rows(logits[i:i + 1].clone(), [row])[0].token_id for i, row in enumerate(rows)]
    rng = random.Random(1)
    for _ in range(4):   # any batch, any order
        order = list(range(len(rows)))
        rng.shuffle(order)
        sub = order[:rng.randrange(2, len(rows) + 1)]
        got = COUNTER.sample_rows(logits[sub].clone(), [rows[i] for i in sub])
        assert [r.token_id for r in got] == [alone[i] for i in sub]
    # the same seed at the same step draws the same; steps and seeds move the draws
    x = rand_logits(1, vocab, 3, scale=0.5)

    def stream(seed: int) -> list[int]:
        state = SamplingState.create(GenerationConfig(temperature=1.0, seed=seed))
        return [COUNTER.sample_rows(x.clone(), [(state, [1] + [0] * s, [0] * s)])[0].token_id for s in range(40)]
    a, b, c = stream(7), stream(7), stream(8)
    assert a == b and a != c and len(set(a)) > 10
    # unseeded requests get a random seed each
    seeds = {SamplingState.create(GenerationConfig(temperature=1.0)).seed for _ in range(3)}
    assert len(seeds) == 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = float(counts.sum())
    on = probs > 0
    expected = n * probs[on]
    return float(((counts[on] - expected) ** 2 / expected).sum()), int(on.sum()) - 1


DIST_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=4),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.1, top_k=5, top_p=0.9, mask=2),   # token 2 disallowed (-inf) beforehand
]


@pytest.mark.parametrize("case", DIST_CASES)
def test_draw_distribution_is_the_processed_softmax(case):
    """20,000 counter-based draws of a 6-token row: 200 seeds x steps 0..99 through the sampler, and one seed over steps
    0..19,999 (its key stream). A correct sampler's chi-square exceeds the bound with probability 1e-6; with
    20,000 draws a wrong temperature or a leaked masked token pushes it far past it (checked below)."""
    cfg = dict(case)
    masked = cfg.pop("mask", None)
    x = torch.tensor([[1.2, 0.9, 1.5, 0.3, -0.2, 0.6]])
    if masked is not None:
        x[0, masked] = NEG_INF
    t = cfg["temperature"]
    ref = hf_apply(TemperatureLogitsWarper(t), [], x[0])
    ref = hf_apply(TopKLogitsWarper(cfg["top_k"]), [], ref) if cfg.get("top_k") else ref
    ref = hf_apply(TopPLogitsWarper(cfg["top_p"]), [], ref) if cfg.get("top_p") else ref
    probs = torch.softmax(ref.double(), -1)
    if len(cfg) > 1:
        assert int((probs == 0).sum()) >= 1 + (masked is not None), "the case should cut something"
    outputs = [[0] * s for s in range(100)]
    rows = [(SamplingState.create(GenerationConfig(seed=seed, **cfg)), [5] + out, out)
            for seed in range(200) for out in outputs]
    tokens = [r.token_id for r in COUNTER.sample_rows(x.expand(len(rows), -1).clone(), rows)]
    # one request's own stream: keys of steps 0..19,999, the same processing
    xs = mask_top_k_top_p(x / t, [cfg.get("top_k", 0)], [cfg.get("top_p", 1.0)])
    noise = gumbel_noise([draw_key(12345, s) for s in range(20_000)], 6, "cpu")
    for drawn in (torch.tensor(tokens), (xs + noise).argmax(-1)):
        counts = torch.bincount(drawn, minlength=6).double()
        assert counts[probs == 0].sum() == 0, "drew a token that top_k / top_p / a mask removed"
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_1E6[df], (stat, counts.tolist(), (probs * 20_000).tolist())
        # the bound has power: the untempered distribution is rejected
        wrong = torch.softmax(x[0].double(), -1)
        assert chi_square(counts, wrong)[0] > 10 * CHI2_1E6[5]


# ------------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
def test_cuda_logits_give_the_cpu_results():
    """A GPU's sampler on CUDA logits equals the counter-based draws on the same CPU logits."""
    logits, cfgs, histories = mixed_batch(1000, 4)
    rows = rows_of(cfgs, histories)
    gpu = Sampler(torch.device("cuda")).sample_rows(logits.cuda(), rows)
    cpu = COUNTER.sample_rows(logits.clone(), rows)
    assert [r.token_id for r in gpu] == [r.token_id for r in cpu]
    for g, c in zip(gpu, cpu):
        assert (g.logprob is None) == (c.logprob is None)
        if c.logprob is not None:
            assert g.logprob == pytest.approx(c.logprob, abs=1e-5)
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in c.top_logprobs]
    assert mix32(torch.arange(2**20, device="cuda")).cpu().tolist() == mix32(torch.arange(2**20)).tolist()


@pytest.mark.gpu
@needs_gpu
def test_gpu_engine_alone_equals_batched(llama, tmp_path):
    """On the GPU, greedy requests with penalties + logprobs and seeded sampling requests give the same tokens
    alone and batched together; the greedy ones equal the CPU engine's."""
    from helpers import generate, random_prompt, serialize, start_engine
    from test_cuda import cuda_engine
    loader = serialize(llama.hf_dir, "bs", str(tmp_path))
    engine = cuda_engine(loader, "bs")
    common = dict(max_new_tokens=16, eos_token_id=[], logprobs=True, top_logprobs=3)
    jobs = [(random_prompt(9, 1), dict(common, top_k=1, repetition_penalty=1.3, presence_penalty=0.4,
                                       frequency_penalty=0.2)),
            (random_prompt(14, 2), dict(common, temperature=0.8, top_k=50, top_p=0.9, seed=5)),
            (random_prompt(5, 3), dict(common, do_sample=False, repetition_penalty=0.9)),
            (random_prompt(20, 4), dict(common, temperature=1.2, seed=6))]
    alone = [generate(engine, "bs", p, g)[0] for p, g in jobs]
    together = [None] * len(jobs)

    def run(i):
        together[i] = generate(engine, "bs", *jobs[i])[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    cpu = start_engine(loader, "bs_cpu", max_batch=4, max_length=256)
    for i in (0, 2):
        assert generate(cpu, "bs_cpu", *jobs[i])[0] == alone[i]
