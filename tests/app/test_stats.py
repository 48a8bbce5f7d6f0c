"""Running statistics: tokens/s and speedup arithmetic, and the per-step chart."""

import xml.etree.ElementTree as ET

import pytest

from specflow.app.stats import RunStats, render_accept_chart, render_stats

SVG = "{http://www.w3.org/2000/svg}"


def test_speedup_is_the_ratio_of_tokens_per_second_to_plain_decoding():
    stats = RunStats(accept_lengths=[3, 1, 4], tokens=9, seconds=0.5)
    assert stats.tokens_per_s == 18.0 and stats.mean_accept_length == 8 / 3
    assert stats.speedup is None
    stats.baseline_tokens_per_s = 6.0
    assert stats.speedup == 3.0


def test_chart_has_one_bar_per_step_and_marks_the_current_one():
    svg = ET.fromstring(render_accept_chart([1, 3, 2, 5], current=1))
    bars = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "bar"]
    assert len(bars) == 4
    heights = [float(b.get("height")) for b in bars]
    assert heights.index(max(heights)) == 3 and heights[1] == pytest.approx(3 * heights[0], abs=0.2)
    assert [b.get("fill") for b in bars].count(bars[1].get("fill")) == 1  # only step 2 is drawn darker


def test_stats_panel_says_measuring_until_plain_decoding_is_timed():
    stats = RunStats([2, 2], tokens=5, seconds=1.0)
    running = render_stats(stats, state="running")
    ET.fromstring(running)
    assert "measuring…" in running and "same tokens as plain" not in running
    stats.baseline_tokens_per_s, stats.matches_baseline = 2.5, True
    done = render_stats(stats, current=1, state="done")
    assert "2.00×" in done and "same tokens as plain" in done
    assert "—" in render_stats(RunStats(), state="stopped")


def test_a_generation_of_one_token_has_no_accept_length():
    """max_tokens 1: the prefill's token alone, no speculative step (it read 0.00)."""
    html = render_stats(RunStats([], tokens=1, seconds=0.1, baseline_tokens_per_s=10.0), state="done")
    assert ">—</div><div class='sf-label'>accepted length" in html
