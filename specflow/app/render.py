"""Draft trees as SVG: one StepRecord in, one picture out (pure functions, no Gradio).

The tree grows left to right, one column per depth. Every valid node is a box with its token
text and its draft probability q(token | parent) = score / parent score; the accepted path is
green along the top row, rejected nodes are faded, and the bonus token (sampled from the target
at the last accepted node) ends the path as a dashed amber box. Padding nodes are not drawn.

Elements carry classes a browser test or a stylesheet can select: ``node``/``edge`` plus one of
``root``, ``accepted``, ``rejected``, ``bonus``; each node has ``data-node`` (its index, or
``bonus``) and a ``<title>`` tooltip.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape

from specflow.tree import StepRecord

BOX_W, BOX_H = 80, 36        # node box in px; 10 characters of 12px monospace fit in BOX_W
COL_W, ROW_H = 108, 44       # column pitch (box + edge room) and row pitch
MARGIN = 8
MAX_CHARS = 10               # longer token texts are cut with an ellipsis (full text in the tooltip)

STYLE = {  # fill, stroke, text colour, opacity, stroke dash
    "root": ("#dbeafe", "#2563eb", "#1e3a8a", 1.0, ""),
    "accepted": ("#dcfce7", "#16a34a", "#14532d", 1.0, ""),
    "rejected": ("#f3f4f6", "#9ca3af", "#4b5563", 0.5, ""),
    "bonus": ("#fef3c7", "#d97706", "#78350f", 1.0, "5 3"),
}
EDGE = {"accepted": ("#16a34a", 2.5, 1.0), "rejected": ("#9ca3af", 1.2, 0.5),
        "bonus": ("#d97706", 2.0, 1.0)}  # stroke, width, opacity
BONUS = -1                   # node id of the bonus box in the layout


def token_label(text: str, limit: int = MAX_CHARS) -> str:
    """A token's text made visible: spaces, newlines, tabs and control characters shown as glyphs."""
    shown = text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)
    if not shown:
        return "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def prob_label(q: float) -> str:
    """q with two decimals, or one significant digit below 0.005 (sampled drafts draw such tokens:
    "0.00" would read as impossible)."""
    return f"{q:.2f}" if q == 0 or q >= 0.005 else f"{q:.1g}"


def node_probs(tree: dict) -> list[float]:
    """Per-node draft probability q(token | parent): cumulative score over the parent's (root 1)."""
    scores, parents = tree["scores"], tree["parents"]
    probs = [1.0] * len(scores)
    for i in range(1, len(scores)):
        parent = scores[parents[i]]
        probs[i] = scores[i] / parent if parent > 0 else 0.0
    return probs


def layout(parents: list[int], valid: list[bool], accepted: list[int]) -> dict[int, tuple[int, float]]:
    """``node -> (column, row)`` for every valid node and the bonus (id ``BONUS``).

    Children are taken with the one on the ``accepted`` path first (the bonus under the path's last
    node), then in node-index order; leaves take consecutive rows in depth-first order and a parent
    sits on its first child's row, so edges never cross and the accepted path with its bonus is the
    top row, in view however large the tree.
    """
    children: dict[int, list[int]] = {i: [] for i, v in enumerate(valid) if v}
    for i in range(1, len(parents)):
        if valid[i] and parents[i] in children:
            children[parents[i]].append(i)
    children[accepted[-1]].append(BONUS)
    children[BONUS] = []
    on_path = {*accepted, BONUS}
    for kids in children.values():
        kids.sort(key=lambda k: k not in on_path)   # (stable: the rest keep their index order)
    place: dict[int, tuple[int, float]] = {}
    next_row = 0
    stack: list[tuple[int, int, bool]] = [(0, 0, False)]  # (node, column, children placed)
    while stack:
        node, col, done = stack.pop()
        kids = children[node]
        if not kids:
            place[node] = (col, float(next_row))
            next_row += 1
        elif done:
            place[node] = (col, place[kids[0]][1])
        else:
            stack.append((node, col, True))
            stack.extend((k, col + 1, False) for k in reversed(kids))
    return place


def _center(col: int, row: float) -> tuple[float, float]:
    return MARGIN + col * COL_W + BOX_W / 2, MARGIN + row * ROW_H + BOX_H / 2


def _edge(kind: str, a: tuple[int, float], b: tuple[int, float]) -> str:
    (x0, y0), (x1, y1) = _center(*a), _center(*b)
    x0, x1 = x0 + BOX_W / 2, x1 - BOX_W / 2
    mid = (x0 + x1) / 2
    stroke, width, opacity = EDGE[kind]
    dash = ' stroke-dasharray="5 3"' if kind == "bonus" else ""
    return (f'<path class="edge {kind}" d="M{x0:.1f},{y0:.1f} C{mid:.1f},{y0:.1f} {mid:.1f},{y1:.1f} '
            f'{x1:.1f},{y1:.1f}" fill="none" stroke="{stroke}" stroke-width="{width}" '
            f'opacity="{opacity}"{dash}/>')


def _node(node_id: str, kind: str, pos: tuple[int, float], label: str, note: str, title: str) -> str:
    fill, stroke, ink, opacity, dash = STYLE[kind]
    cx, cy = _center(*pos)
    x, y = cx - BOX_W / 2, cy - BOX_H / 2
    classes = "node root accepted" if kind == "root" else f"node {kind}"
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<g class="{classes}" data-node="{node_id}" opacity="{opacity}">'
            f"<title>{escape(title)}</title>"
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="1.5"{dash_attr}/>'
            f'<text x="{cx:.1f}" y="{cy - 3:.1f}" text-anchor="middle" font-family="ui-monospace, '
            f'Menlo, Consolas, monospace" font-size="12" fill="{ink}">{escape(label)}</text>'
            f'<text x="{cx:.1f}" y="{cy + 12:.1f}" text-anchor="middle" font-family="sans-serif" '
            f'font-size="10" fill="{ink}">{escape(note)}</text></g>')


def render_tree(record: StepRecord, token_text: Callable[[int], str] = str) -> str:
    """The SVG of one step's draft tree; ``token_text`` maps a token id to its text."""
    tree = record.tree
    tokens, parents, valid = tree["tokens"], tree["parents"], tree["valid"]
    probs = node_probs(tree)
    on_path = set(record.accepted)
    last = record.accepted[-1]
    place = layout(parents, valid, record.accepted)

    edges, nodes = [], []
    for i, pos in place.items():
        if i == BONUS:
            continue
        text = token_text(tokens[i])
        if i == 0:
            kind, note = "root", "root"
            title = f"root: {text!r} (id {tokens[i]}), the last committed token"
        else:
            kind = "accepted" if i in on_path else "rejected"
            note = prob_label(probs[i])
            title = (f"node {i}: {text!r} (id {tokens[i]}), q={probs[i]:.3f}, "
                     f"path prob {tree['scores'][i]:.3f}, {kind}")
            edges.append(_edge(kind, place[parents[i]], pos))
        nodes.append(_node(str(i), kind, pos, token_label(text), note, title))
    bonus_text = token_text(record.bonus_token)
    edges.append(_edge("bonus", place[last], place[BONUS]))
    nodes.append(_node("bonus", "bonus", place[BONUS], token_label(bonus_text), "bonus",
                       f"bonus: {bonus_text!r} (id {record.bonus_token}), sampled from the target "
                       f"after node {last}"))

    width = MARGIN * 2 + max(c for c, _ in place.values()) * COL_W + BOX_W
    height = MARGIN * 2 + int(max(r for _, r in place.values())) * ROW_H + BOX_H
    # scales down to fit its container, never up
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="draft-tree" data-step="{record.step}" '
            f'width="100%" viewBox="0 0 {width} {height}" style="max-width: {width}px" role="img" '
            f'aria-label="draft tree of step {record.step + 1}">'
            + "".join(edges) + "".join(nodes) + "</svg>")


def render_step(record: StepRecord, token_text: Callable[[int], str] = str, num_steps: int | None = None) -> str:
    """HTML for one step: a caption (nodes, accepted tokens, timings), the tree, and a legend."""
    drafted = sum(record.tree["valid"]) - 1
    accepted = len(record.accepted) - 1
    kept = record.accepted[1:][: record.kept]   # (max_tokens, an EOS or a stop may end the request inside them)
    committed = "".join(token_text(record.tree["tokens"][i]) for i in kept)
    tokens = f"<code>{escape(token_label(committed, 40))}</code>" if committed else ""
    if record.kept > accepted:
        tokens += f"<code class='bonus'>{escape(token_label(token_text(record.bonus_token), 20))}</code>"
    of = f" of {num_steps}" if num_steps else ""
    timings = "".join(f" · {k} {v * 1e3:.1f} ms" for k, v in record.timings.items())
    ended = f" (the request ended there: {accepted + 1 - record.kept} not kept)" if record.kept <= accepted else ""
    caption = (f"<b>Step {record.step + 1}{of}</b> · {drafted} draft nodes · accepted {accepted} + bonus → "
               f"{record.kept} token{'s' if record.kept != 1 else ''}{ended} {tokens}{timings}")
    legend = "".join(
        f"<span><svg width='14' height='10'><rect x='1' y='1' width='12' height='8' rx='2' fill='{fill}' "
        f"stroke='{stroke}' opacity='{opacity}'/></svg> {name}</span>"
        for name, (fill, stroke, _, opacity, _) in STYLE.items())
    return (f"<div class='sf-step'><div class='sf-caption'>{caption}</div>"
            f"<div class='sf-tree'>{render_tree(record, token_text)}</div>"
            f"<div class='sf-legend'>{legend}</div></div>")
