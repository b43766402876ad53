"""MTP speculative decoding: greedy output equals plain greedy decoding, acceptance counts
(oracle draft: all, wrong draft: none), the MTP cache rollback, the acceptance rule reproduces
the target distribution (exactly on hand-made p and q, empirically end to end), and the CLI."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hyperloom.accelerator import Accelerator
from hyperloom.config import ModelConfig, load_config, preset_config
from hyperloom.engine.ops import OpImpls
from hyperloom.inference import generate
from hyperloom.inference import speculative as spec
from hyperloom.models.deepseek.mla import MLACache
from hyperloom.models.registry import init_model
from hyperloom.train.trainer import Trainer

CPU = Accelerator("cpu")


def small(**overrides) -> ModelConfig:
    """1 dense + 1 MoE layer (4 experts, top-2), MLA with a low-rank query, one MTP module."""
    base = dataclasses.replace(
        preset_config("moe-tiny"),
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_dense_layers=1,
        n_heads=2,
        n_kv_heads=2,
        ffn_dim=64,
        n_routed_experts=4,
        moe_top_k=2,
        moe_ffn_dim=16,
        moe_n_groups=1,
        moe_topk_groups=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        max_seq_len=64,
        mtp_depth=1,
    )
    return dataclasses.replace(base, **overrides)


def build(cfg: ModelConfig, seed: int = 0):
    return init_model(cfg, "cpu", seed).use_ops(OpImpls.choose(compile=False)).eval()


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2 + 3 * i,), generator=gen).tolist() for i in range(n)]


class ScriptedDrafter:
    """Proposes the reference continuation shifted by `offset` (0: an oracle, 1: always wrong)."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int, offset: int):
        self.stream, self.vocab, self.offset = prompt + reference, vocab, offset

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        pass

    def propose(self, tokens, n, sampler):
        nxt = self.stream[len(tokens) : len(tokens) + n]
        return [((t + self.offset) % self.vocab, None) for t in nxt]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_speculative_equals_plain_greedy(depth):
    cfg = small(mtp_depth=depth)
    model = build(cfg)
    for prompt, n in zip(prompts(3, cfg.vocab_size), (1, 9, 20), strict=True):
        plain = generate(model, prompt, n, temperature=0.0)
        for use_cache in (True, False):
            out, stats = spec.generate(model, prompt, n, temperature=0.0, use_cache=use_cache)
            assert out == plain and len(out) == n
            assert 0.0 <= stats.acceptance_rate <= 1.0
            assert stats.new_tokens == n and stats.accepted <= stats.drafted
            assert stats.forwards == n - stats.accepted  # each accepted draft saves a forward
    # Stopping at eos: the same tokens, cut after the first eos.
    prompt = prompts(1, cfg.vocab_size, seed=5)[0]
    plain = generate(model, prompt, 16, temperature=0.0)
    eos = plain[6]
    out, _ = spec.generate(model, prompt, 16, temperature=0.0, eos_id=eos)
    assert out == plain[: plain.index(eos) + 1]
    # The sequence limit: max_seq_len caps the continuation as in plain decoding.
    long = prompts(1, cfg.vocab_size, seed=6)[0] * 30  # 60 of 64 positions
    assert spec.generate(model, long, 50, temperature=0.0)[0] == generate(
        model, long, 50, temperature=0.0
    )


@pytest.mark.parametrize("depth", [1, 2])
def test_oracle_draft_accepts_all_and_wrong_draft_none(depth):
    cfg = small(mtp_depth=depth)
    model = build(cfg)
    for prompt, n in zip(prompts(2, cfg.vocab_size), (13, 20), strict=True):
        plain = generate(model, prompt, n, temperature=0.0)
        oracle = ScriptedDrafter(prompt, plain, cfg.vocab_size, offset=0)
        out, stats = spec.generate(model, prompt, n, temperature=0.0, drafter=oracle)
        assert out == plain
        assert stats.acceptance_rate == 1.0 and stats.drafted > 0
        # The prompt's forward yields one token, every verify forward D + 1.
        assert stats.forwards == 1 + math.ceil((n - 1) / (depth + 1)) < n
        wrong = ScriptedDrafter(prompt, plain, cfg.vocab_size, offset=1)
        out, stats = spec.generate(model, prompt, n, temperature=0.0, drafter=wrong)
        assert out == plain
        assert stats.acceptance_rate == 0.0 and stats.drafted > 0 and stats.forwards == n


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mtp_drafts_with_cache_equal_recomputed_drafts(depth):
    """The MTP modules' cache, rolled back over drafted positions, gives the same draft
    distributions as running the modules over the whole committed sequence every round."""
    cfg = small(mtp_depth=depth)
    model = build(cfg)
    stream = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with spec._last_hidden(model) as seen, torch.no_grad():
        model(stream)
    hidden = seen[0]  # (1, 40, dim) the main model's h⁰ of every position
    cache = MLACache.allocate(cfg, cfg.n_layers + depth, 1, 40, CPU.device, torch.float32)
    cached = spec.MTPDrafter(model, cache, 40, CPU, torch.float32)
    pos, n = 0, 4  # main positions seen, committed tokens
    for step in (1, 3, 2, 1, 4, 2, 5):  # tokens committed per round: some drafts accepted
        tokens = stream[0, :n].tolist()
        cached.observe(hidden[:, pos : n - 1], pos)
        fresh = spec.MTPDrafter(model, None, 40, CPU, torch.float32)
        fresh.observe(hidden[:, : n - 1], 0)
        a, b = (
            d.propose(tokens, depth, spec.Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(n)))
            for d in (cached, fresh)
        )
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, qa), (_, qb) in zip(a, b, strict=True):
            assert (qa - qb).abs().max().item() < 1e-6
        pos, n = n - 1, n + step


def test_acceptance_rule_reproduces_the_target_exactly():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        p, q = torch.rand(2, 7, generator=gen, dtype=torch.float64)
        p[trial % 7] = 0.0  # tokens only one side can produce
        q[(trial + 3) % 7] = 0.0
        p, q = p / p.sum(), q / q.sum()
        a, r = spec.acceptance_probability(p, q), spec.residual_distribution(p, q)
        # P(x) = q(x) a(x) + P(reject) r(x)
        out = q * a + (q * (1 - a)).sum() * r
        assert torch.allclose(out, p, atol=1e-12)
    one_hot = torch.eye(5, dtype=torch.float64)
    # Greedy: a draft passes iff it is the verifier's argmax, the correction is that argmax.
    assert spec.acceptance_probability(one_hot[2], one_hot[2])[2] == 1.0
    assert spec.acceptance_probability(one_hot[2], one_hot[4])[4] == 0.0
    assert torch.equal(spec.residual_distribution(one_hot[2], one_hot[4]), one_hot[2])


def test_accept_or_resample_draws_from_the_target():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    q = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35])  # far from p: most drafts are rejected
    gen = torch.Generator().manual_seed(0)
    draws, counts, accepted = 4000, torch.zeros(5), 0
    for _ in range(draws):
        token = int(torch.multinomial(q, 1, generator=gen))
        ok, out = spec.accept_or_resample(p, q, token, gen)
        counts[out] += 1
        accepted += ok
    assert 0.5 * (counts / draws - p).abs().sum() < 0.03  # TV(q, p) itself is 0.6
    assert counts[4] == 0  # never a token the target cannot produce
    assert abs(accepted / draws - torch.minimum(p, q).sum().item()) < 0.03  # 0.4 expected


def test_speculative_sampling_matches_the_target_distribution():
    """The first drafted-and-verified token (the second new one) follows the model's own
    distribution Σ_x p(x | prompt) p(y | prompt, x), though the MTP draft does not."""
    cfg = small(
        vocab_size=8, n_layers=1, n_routed_experts=0, q_lora_rank=0, max_seq_len=16, init_std=0.5
    )
    model = build(cfg)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)  # (vocab,)
        nxt = torch.tensor([prompt + [x] for x in range(cfg.vocab_size)])
        with spec._last_hidden(model) as seen:
            p2_given = model(nxt)[:, -1].softmax(-1)  # (x, y)
    target = p1 @ p2_given
    # The draft's own marginal, to show the check has teeth.
    q2_given = []
    for x in range(cfg.vocab_size):
        drafter = spec.MTPDrafter(model, None, 16, CPU, torch.float32)
        drafter.observe(seen[0][x : x + 1, : len(prompt)], 0)
        sampler = spec.Sampler(1.0, 0, 1.0, torch.Generator())
        q2_given.append(drafter.propose(prompt + [x], 1, sampler)[0][1])
    draft = p1 @ torch.stack(q2_given)
    assert 0.5 * (draft - target).abs().sum() > 0.3
    draws, counts, drafted = 400, torch.zeros(cfg.vocab_size), 0
    for seed in range(draws):
        out, stats = spec.generate(model, prompt, 3, temperature=1.0, top_k=0, seed=seed)
        counts[out[1]] += 1
        drafted += stats.drafted
    assert drafted == draws  # one MTP draft per call, judged by the acceptance rule
    assert 0.5 * (counts / draws - target).abs().sum() < 0.08


@pytest.fixture(scope="module")
def deepseek_runs(tmp_path_factory, tiny_job_args):
    """Two tiny DeepSeek checkpoints trained a few steps: with one MTP module and without."""
    runs = {}
    for depth in (1, 0):
        run_dir = tmp_path_factory.mktemp(f"mtp{depth}")
        args = tiny_job_args(
            run_dir,
            model__preset="moe-tiny",
            model__n_heads=2,
            model__n_kv_heads=2,
            model__moe_ffn_dim=32,
            model__mtp_depth=depth,
            train__steps=3,
            train__micro_batch_size=2,
            data__seq_len=32,
        )
        Trainer(load_config(None, args)).run()
        runs[depth] = run_dir
    return runs


def test_cli_speculative_reports_acceptance_and_matches_plain(deepseek_runs, cli):
    common = ["--checkpoint", str(deepseek_runs[1]), "--prompt", "def ", "--temperature", "0"]
    common += ["--max-new-tokens", "12"]
    result = cli("generate", *common, "--speculative")
    assert result.returncode == 0, result.stderr
    assert "acceptance rate" in result.stderr and "tokens per main-model forward" in result.stderr
    plain = cli("generate", *common)
    assert plain.returncode == 0, plain.stderr
    assert result.stdout == plain.stdout and result.stdout.startswith("def ")


def test_cli_speculative_without_mtp_is_a_clear_error(deepseek_runs, cli):
    args = ["--checkpoint", str(deepseek_runs[0]), "--prompt", "def ", "--speculative"]
    result = cli("generate", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("hyperloom generate: error: --speculative drafts with")
    assert "model.mtp_depth = 0" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
