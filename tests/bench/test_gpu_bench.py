"""The GPU benchmarks of bench/gpu/ run end to end at their tiny shape on the CPU and write the
JSON keys the real runs will; no speed is asserted. Also the shared pieces they rely on."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from specflow.bench import gpu
from specflow.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
ENV_KEYS = {"bench", "device", "torch", "transformers", "flashinfer", "backend", "attention", "dtype", "tiny", "note",
            "git_commit", "git_dirty"}


def script(name: str):
    """bench/gpu/NAME.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_gpu_{name}", ROOT / "bench" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tiny(name: str, tmp_path, *options: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = script(name).main(["--tiny", "--out", str(out), "--device", "cpu", *options])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert ENV_KEYS <= result.keys() and result["device"] == "cpu" and result["bench"] == name
    return result


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


# "on" runs the CUDA-graph engine path (padded static buffers) eagerly on the CPU
GRAPHS = pytest.mark.parametrize("graphs", ["off", "on"])


@GRAPHS
def test_decode_roofline(tmp_path, graphs):
    r = run_tiny("decode_roofline", tmp_path, "--cuda-graphs", graphs)
    assert r["cuda_graphs"] == (graphs == "on")
    assert positive(r["decode_tok_s"], r["hf_static_tok_s"], r["copy_bandwidth_gb_s"], r["roofline_tok_s"],
                    r["decode_vs_roofline"], r["weight_bytes_per_token"], r["mean_kv_bytes_per_token"])
    assert r["decode_vs_roofline"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"])
    assert r["hf_compile_error"] is None  # (no auto-compile on a CPU: an error here is the bench's own)
    assert {"roofline", "engine_step", "runner_forward", "engine_outside_forward"} <= r["step_ms"].keys()
    assert positive(r["step_ms"]["engine_step"], r["step_ms"]["runner_forward"])


@GRAPHS
def test_verify_step(tmp_path, graphs):
    r = run_tiny("verify_step", tmp_path, "--cuda-graphs", graphs)
    assert r["cuda_graphs"] == (graphs == "on")
    assert set(r["verify_step_ratio"]) == {"16", "32", "64"}
    assert positive(r["decode_step_ms"], *r["verify_step_ms"].values(), *r["verify_step_ratio"].values())


@GRAPHS
def test_spec_step(tmp_path, graphs):
    r = run_tiny("spec_step", tmp_path, "--cuda-graphs", graphs, "--profile")
    assert r["cuda_graphs"] == r["drafter_cuda_graphs"] == (graphs == "on")
    assert "5 engine steps, by self CPU time" in (tmp_path / "spec_step.profile.txt").read_text()
    assert r["tree"] == {"type": "eagle2", "topk": 8, "depth": 5, "num_draft_tokens": 64}
    assert positive(r["decode_step_ms"], r["spec_step_ms"], r["spec_step_ratio"], r["spec_step_tokens_per_step"])
    assert positive(r["steady_step_ms"]["decode"], r["steady_step_ms"]["spec"], r["spec_step_ratio_steady"])
    assert r["spec_step_ratio_steady"] == pytest.approx(r["steady_step_ms"]["spec"] / r["steady_step_ms"]["decode"])
    assert [row["batch_size"] for row in r["throughput"]] == r["shapes"]["batch_sizes"]
    for row in r["throughput"]:
        assert positive(row["plain_tok_s"], row["spec_tok_s"]) and row["spec_tokens_per_step"] >= 1


def test_a_longer_context_is_an_option(tmp_path):
    """(the README's backend advice needs steps over a long cached context)"""
    v = run_tiny("verify_step", tmp_path, "--prefix-len", "300")
    assert v["shapes"]["prefix_len"] == 300 and positive(*v["verify_step_ratio"].values())
    r = run_tiny("spec_step", tmp_path, "--prompt-len", "300", "--batch-sizes")
    assert r["shapes"]["prompt_len"] == 300 and r["shapes"]["batch_sizes"] == [] == r["throughput"]
    assert positive(r["decode_step_ms"], r["spec_step_ms"], r["spec_step_ratio_steady"])


def test_steady_step_ms_drains_the_device_around_the_block_only(monkeypatch):
    """Plain decoding launches a step's forward before it lands the last one, so a step timed from
    an idle device (``step_ms``) adds the launch's host work that a running decode hides: the
    steady timing runs its steps back to back, draining the device before and after them only."""
    from specflow.engine import SpecEngine

    events = []
    monkeypatch.setattr(gpu, "synchronize", lambda device: events.append("sync"))
    model = gpu.random_llama(gpu.llama_config(True), torch.device("cpu"), torch.float32)
    engine = SpecEngine(model, verifier={"type": "greedy"}, kv_cache_tokens=256, max_batch_size=1)
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: events.append("step") or step())
    assert positive(gpu.steady_step_ms(engine, [5] * 8, iters=4, warmup=2, device=torch.device("cpu")))
    assert events == ["step"] * 3 + ["sync"] + ["step"] * 4 + ["sync"]


def test_tiny_family(tmp_path):
    r = run_tiny("tiny_family", tmp_path)
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"baseline", "draft_model", "eagle", "eagle3", "hf", "hf_assisted"}
    for name, row in rows.items():
        assert positive(row["tok_s"], row["speedup"])
        assert row["same_tokens_as_plain"] == 1.0, name  # greedy in float32: lossless on both sides
    for name in ("draft_model", "eagle", "eagle3"):
        assert positive(rows[name]["vs_hf_assisted"]) and rows[name]["accept_length"] >= 1


def test_tiny_family_runs_transformers_assisted_generation_with_the_settings_it_records(tmp_path, monkeypatch):
    """transformers' AssistedCandidateGenerator takes num_assistant_tokens and its schedule from the
    assistant model's generation config: what the result records as hf_assisted_generation must be
    what ran (here settings other than transformers' defaults, which would otherwise hide it)."""
    from transformers.generation import candidate_generator

    module = script("tiny_family")
    monkeypatch.setattr(module, "ASSISTED", dict(module.ASSISTED, num_assistant_tokens=3))
    seen = []
    init = candidate_generator.AssistedCandidateGenerator.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append((self.num_assistant_tokens, self.assistant_generation_config.num_assistant_tokens_schedule))

    monkeypatch.setattr(candidate_generator.AssistedCandidateGenerator, "__init__", recording)
    out = tmp_path / "tiny_family.json"
    result = module.main(["--tiny", "--out", str(out), "--device", "cpu"])
    assert result["hf_assisted_generation"]["num_assistant_tokens"] == 3
    assert seen and set(seen) == {(3, "constant")}


def test_random_tree_is_a_bounded_tree():
    depth, mask = script("verify_step").random_tree(64, topk=8, depth=5, gen=torch.Generator().manual_seed(0))
    assert depth[0] == 0 and depth.max() <= 5 and mask.diagonal().all()
    assert torch.equal(mask.sum(1), depth + 1)  # a node sees itself and its depth-many ancestors
    parents = [int(row[:i].nonzero().max()) if i else -1 for i, row in enumerate(mask)]  # deepest ancestor
    assert max(parents.count(p) for p in range(64)) <= 8


def test_hf_llama_shares_weights_and_matches_logits():
    cfg = ModelConfig(**{**gpu.TINY, "max_position_embeddings": 4096})
    model = gpu.random_llama(cfg, torch.device("cpu"), torch.float32)
    hf = gpu.hf_llama(model)
    assert hf.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    qkv = model.model.layers[0].self_attn.qkv_proj.weight  # q/k/v are views of the stacked tensor
    assert hf.model.layers[0].self_attn.v_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.inference_mode():
        hidden, _ = model(ids[0], torch.arange(12), _CausalAttention())
        torch.testing.assert_close(model.compute_logits(hidden), hf(ids).logits[0], rtol=1e-4, atol=1e-4)


class _CausalAttention:
    """Plain causal attention over the forward's own tokens (no cache), for a logits check."""

    def forward(self, layer, q, k, v):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))   # [H, T, D]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)                         # [T, Hq, D]


def test_real_shape_refuses_the_cpu(tmp_path):
    with pytest.raises(SystemExit, match="--tiny"):
        script("decode_roofline").main(["--out", str(tmp_path / "x.json"), "--device", "cpu"])


def test_decode_roofline_times_the_captured_decode_graph(tmp_path, monkeypatch):
    """With graphs captured (emulated on the CPU), ``step_ms`` has the decode graph's replay alone;
    --profile writes its table even where the JSON's folder does not exist yet."""
    from tests.runtime import graph_emulator

    graph_emulator.install(monkeypatch)
    out = tmp_path / "new" / "decode_roofline.json"
    r = script("decode_roofline").main(["--tiny", "--out", str(out), "--device", "cpu", "--cuda-graphs", "on",
                                        "--profile"])
    assert positive(r["step_ms"]["graph_replay"])
    assert "engine steps, by self CPU time" in out.with_suffix(".profile.txt").read_text()


@pytest.mark.parametrize("backend_key, kv_len, expected", [
    (128, 100, True), (256, 100, False), (True, 5000, True), (False, 10, False)])
def test_decode_graph_key(backend_key, kv_len, expected):
    assert script("decode_roofline").decode_graph((1, 1, (), (), backend_key), kv_len) is expected
    assert not script("decode_roofline").decode_graph((2, 1, (), (), backend_key), kv_len)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_reads_one_embedding_row_and_the_whole_lm_head(tied):
    """A decode step reads one row of the embedding table and all of the LM head; a tied model's
    one table is both, so all of it is read once."""
    from specflow.models import LlamaForCausalLM

    cfg = ModelConfig(**{**gpu.TINY, "tie_word_embeddings": tied})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    v, h = cfg.vocab_size, cfg.hidden_size
    body = sum(p.numel() for name, p in model.named_parameters()
               if "embed_tokens" not in name and "lm_head" not in name)
    weights, kv = script("decode_roofline").decode_bytes(model, mean_context=10.5)
    assert weights == 4 * (body + v * h + (0 if tied else h))   # float32: LM head, + one embedding row untied
    assert kv == int(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 10.5)
