"""results.md: failed pipelines apart from the numbers, untimed categories, implausible speedups flagged."""

from specflow.bench.report import best_pipeline, write_report

LATENCY = {"p50": 0.1, "p90": 0.1, "p99": 0.1}


def test_report_flags_noise_and_untimed_categories_and_lists_failures_apart(tmp_path):
    baseline = {"prompts": 2, "tokens": 20, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
                "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0},
                                                     "chat": {"accept_length": 1.0}}}
    fast = {"prompts": 2, "tokens": 20, "accept_length": 2.0, "tokens_per_s": 300.0, "speedup": 3.0,
            "lossless": True, "matches_baseline": 1.0, "latency_s": LATENCY,
            "categories": {"code": {"accept_length": 2.0, "tokens_per_s": 150.0, "speedup": 1.5},
                           "chat": {"accept_length": 1.5}}}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 2, "num_prompts": 2, "repeats": 1,
               "sampling": {"temperature": 0.0, "max_tokens": 10}, "torch_version": "2.5", "git_commit": None,
               "pipelines": {"baseline": baseline, "fast": fast, "broken": {"error": "ValueError: bad draft"}}}
    assert best_pipeline(results) == "fast"                       # the failed point is not ranked
    results["best"] = "fast"
    write_report(results, {"baseline": [{"accept_lengths": [1] * 10}], "fast": [{"accept_lengths": [2] * 5}]},
                 tmp_path)
    md = (tmp_path / "results.md").read_text()
    # a 3x speedup from 2 tokens a step cannot be real: marked, and the mark explained
    assert "| fast | yes | 2.00 | 300.0 | 3.00x† | 100% |" in md and "† speedup above the accept length" in md
    # chat shares its batches with other categories: its accept length, no speedup, and why
    assert "| baseline | 1.00 / - | 1.00 / 1.00x |" in md and "| fast | 1.50 / - | 2.00 / 1.50x |" in md
    assert '"-": the category shares its batches' in md
    assert "## Best\n\n`fast`: speedup 3.00x, accept length 2.00" in md
    assert md.count("broken") == 1 and "## Failed pipelines\n\n- `broken`: ValueError: bad draft" in md
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_the_header_does_not_promise_exact_lossy_pipelines(tmp_path):
    """A plugin verifier may be lossy at temperature 0 (top-k acceptance: 0 % of prompts matched);
    the header said "at temperature 0 every pipeline is exact" above it."""
    base = {"prompts": 1, "tokens": 8, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
            "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0}}}
    lossy = base | {"accept_length": 2.3, "speedup": 1.2, "lossless": False, "matches_baseline": 0.0,
                    "categories": {"code": {"accept_length": 2.3, "tokens_per_s": 120.0, "speedup": 1.2}}}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 1, "num_prompts": 1,
               "repeats": 1, "sampling": {"temperature": 0.0, "max_tokens": 8}, "torch_version": "2.5",
               "git_commit": None, "pipelines": {"baseline": base, "topk": lossy}}
    write_report(results, {"baseline": [{"accept_lengths": [1] * 8}], "topk": [{"accept_lengths": [2] * 4}]}, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| topk | no | 2.30 |" in md and "| 0% |" in md
    assert "every pipeline is exact" not in md and "at temperature 0 such a pipeline is exact" in md


def test_turns_the_context_cut_are_listed_by_pipeline(tmp_path):
    base = {"prompts": 2, "tokens": 8, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
            "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0}},
            "turns_shortened": ["a/2"], "turns_left_out": []}
    cut = base | {"turns_shortened": [], "turns_left_out": ["a/2", "b/2"]}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 1, "num_prompts": 2,
               "turns": 2, "repeats": 1, "sampling": {"temperature": 0.7, "max_tokens": 8}, "torch_version": "2.5",
               "git_commit": None, "pipelines": {"baseline": base, "p": cut, "q": base | {"turns_shortened": []}}}
    write_report(results, {n: [{"accept_lengths": [1] * 8}] for n in ("baseline", "p", "q")}, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "batch size 1, 2 prompts of up to 2 turns (a row each), temperature" in md
    assert "## Cut by the model's context" in md and "`q`" not in md.split("## Cut")[1]
    assert "- `baseline`: 1 shortened, 0 left out (none)" in md and "- `p`: 0 shortened, 2 left out (a/2, b/2)" in md


def test_a_declared_lossless_pipeline_that_parts_from_greedy_baseline_is_flagged(tmp_path):
    """A plugin verifier that accepts every draft but declares lossless = True matched 0 % of the
    greedy baseline while results.md said "lossless: yes" and "at temperature 0 such a pipeline is exact"."""
    base = {"prompts": 1, "tokens": 8, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
            "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0}}}
    liar = base | {"accept_length": 3.8, "speedup": 1.8, "lossless": True, "matches_baseline": 0.0,
                   "categories": {"code": {"accept_length": 3.8, "tokens_per_s": 180.0, "speedup": 1.8}}}
    honest = liar | {"matches_baseline": 1.0}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 1, "num_prompts": 1,
               "repeats": 1, "sampling": {"temperature": 0.0, "max_tokens": 8}, "torch_version": "2.5",
               "git_commit": None, "pipelines": {"baseline": base, "liar": liar, "honest": honest}}
    rows = {n: [{"accept_lengths": [1] * 8}] for n in ("baseline", "liar", "honest")}
    write_report(results, rows, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| liar | yes§ | 3.80 |" in md and "| honest | yes | 3.80 |" in md
    assert "§ declared lossless, yet at temperature 0" in md
    # sampled runs are exact in distribution only: no flag there
    results["sampling"]["temperature"] = 0.8
    write_report(results, rows, tmp_path)
    assert "§" not in (tmp_path / "results.md").read_text()


def test_times_taken_with_check_drafts_on_are_marked(tmp_path):
    """check_drafts waits for the device every step; a run timed with it on said nothing of it
    outside config.yaml."""
    base = {"prompts": 1, "tokens": 8, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
            "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0}}}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 1, "num_prompts": 1,
               "repeats": 1, "sampling": {"temperature": 0.0, "max_tokens": 8}, "torch_version": "2.5",
               "git_commit": None, "check_drafts": False, "pipelines": {"baseline": base}}
    rows = {"baseline": [{"accept_lengths": [1] * 8}]}
    write_report(results, rows, tmp_path)
    assert "check_drafts" not in (tmp_path / "results.md").read_text()
    write_report(results | {"check_drafts": True}, rows, tmp_path)
    assert "**engine.check_drafts is on**: each step" in (tmp_path / "results.md").read_text()


def test_a_share_of_matching_prompts_reads_as_all_or_none_only_when_it_is(tmp_path):
    """A pipeline matching the baseline on 479 of 480 prompts read "100%" in results.md (sampled or
    lossy, without the § that flags a greedy lossless one), and 1 of 480 read "0%"."""
    base = {"prompts": 480, "tokens": 8, "accept_length": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
            "latency_s": LATENCY, "categories": {"code": {"accept_length": 1.0, "tokens_per_s": 100.0}}}
    shares = {"all": 1.0, "most": 479 / 480, "half": 0.5, "one": 1 / 480, "none": 0.0}
    results = {"name": "x", "target": "t", "device": "cpu", "dtype": "float32", "batch_size": 1, "num_prompts": 480,
               "repeats": 1, "sampling": {"temperature": 0.8, "max_tokens": 8}, "torch_version": "2.5",
               "git_commit": None, "pipelines": {"baseline": base} | {n: base | {"lossless": False,
                                                                              "matches_baseline": f}
                                                                     for n, f in shares.items()}}
    write_report(results, {n: [{"accept_lengths": [1] * 8}] for n in results["pipelines"]}, tmp_path)
    md = (tmp_path / "results.md").read_text()
    for name, text in {"all": "100%", "most": ">99%", "half": "50%", "one": "<1%", "none": "0%"}.items():
        assert f"| {name} | no | 1.00 | 100.0 | 1.00x | {text} |" in md
