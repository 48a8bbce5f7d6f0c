"""Running statistics of one pipeline's generation and their HTML (pure functions, no Gradio)."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

CHART_W, CHART_H = 520, 100  # accepted-length chart in px (the SVG scales to its column)
PAD_L, PAD_B, PAD_T = 24, 14, 6


@dataclass
class RunStats:
    """Tokens, step timing and acceptance of one generation, against plain decoding of the same prompt.

    ``seconds`` counts only the engine steps of this generation (prefill included), so two
    pipelines stepped in turn are timed fairly. ``baseline_tokens_per_s`` is None until plain
    decoding of the same prompt has been measured; ``matches_baseline`` is None unless both
    decoded greedily.
    """

    accept_lengths: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    baseline_tokens_per_s: float | None = None
    matches_baseline: bool | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def speedup(self) -> float | None:
        if not self.baseline_tokens_per_s:
            return None
        return self.tokens_per_s / self.baseline_tokens_per_s


def render_accept_chart(accept_lengths: list[int], current: int | None = None) -> str:
    """SVG bar chart of tokens committed per step (accepted drafts + bonus); ``current`` (0-based)
    is drawn darker, the mean as a dashed line."""
    top = max([2, *accept_lengths])
    plot_w, plot_h = CHART_W - PAD_L - 4, CHART_H - PAD_B - PAD_T
    n = max(1, len(accept_lengths))
    pitch = plot_w / n
    bar_w = max(1.0, pitch * 0.8)

    def y(v: float) -> float:
        return PAD_T + plot_h * (1 - v / top)

    parts = [f'<line x1="{PAD_L}" y1="{y(0):.1f}" x2="{CHART_W - 4}" y2="{y(0):.1f}" stroke="#9ca3af"/>']
    for tick in sorted({1, top // 2, top} - {0}):
        parts.append(f'<text x="{PAD_L - 4}" y="{y(tick) + 3:.1f}" text-anchor="end" font-size="9" '
                     f'fill="#6b7280">{tick}</text>')
    for i, v in enumerate(accept_lengths):
        colour = "#15803d" if i == current else "#86efac"
        parts.append(f'<rect class="bar" x="{PAD_L + i * pitch + (pitch - bar_w) / 2:.1f}" y="{y(v):.1f}" '
                     f'width="{bar_w:.1f}" height="{plot_h * v / top:.1f}" fill="{colour}">'
                     f"<title>step {i + 1}: {v} tokens</title></rect>")
    if accept_lengths:
        mean = sum(accept_lengths) / len(accept_lengths)
        parts.append(f'<line class="mean" x1="{PAD_L}" y1="{y(mean):.1f}" x2="{CHART_W - 4}" y2="{y(mean):.1f}" '
                     f'stroke="#d97706" stroke-dasharray="4 3"><title>mean {mean:.2f}</title></line>')
    parts.append(f'<text x="{PAD_L}" y="{CHART_H - 2}" font-size="9" fill="#6b7280">tokens committed per step '
                 f'({len(accept_lengths)} steps)</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="accept-chart" width="100%" '
            f'viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="accepted length per step">'
            + "".join(parts) + "</svg>")


def render_stats(stats: RunStats, current: int | None = None, state: str = "") -> str:
    """HTML: accepted length, tokens/s, speedup against plain decoding, and the per-step chart."""
    if stats.speedup is not None:
        speedup = f"{stats.speedup:.2f}×"
    else:
        speedup = "measuring…" if state in ("running", "done") else "—"
    accepted = f"{stats.mean_accept_length:.2f}" if stats.accept_lengths else "—"   # (the prefill's token alone)
    cells = [("accepted length", accepted), ("tokens", str(stats.tokens)),
             ("tokens/s", f"{stats.tokens_per_s:.1f}"), ("speedup vs plain", speedup)]
    if stats.matches_baseline is not None:
        cells.append(("same tokens as plain", "yes" if stats.matches_baseline else "no"))
    row = "".join(f"<div class='sf-stat'><div class='sf-value'>{escape(v)}</div>"
                  f"<div class='sf-label'>{escape(k)}</div></div>" for k, v in cells)
    badge = f"<span class='sf-state sf-{escape(state)}'>{escape(state)}</span>" if state else ""
    return (f"<div class='sf-stats' data-state='{escape(state)}'>{badge}<div class='sf-row'>{row}</div>"
            f"{render_accept_chart(stats.accept_lengths, current)}</div>")
