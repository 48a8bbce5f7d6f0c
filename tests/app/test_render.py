"""The pure tree renderer: every valid node drawn once with its text and q, the accepted path,
rejected nodes and the bonus marked, padding omitted, well-formed and deterministic SVG."""

import dataclasses
import xml.etree.ElementTree as ET

from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.app.render import BOX_H, node_probs, render_step, render_tree, token_label
from specflow.tree import StepRecord

SVG = "{http://www.w3.org/2000/svg}"


def nodes_of(svg: str) -> dict[str, ET.Element]:
    root = ET.fromstring(svg)
    groups = [g for g in root.iter(f"{SVG}g") if "node" in g.get("class", "").split()]
    ids = [g.get("data-node") for g in groups]
    assert len(ids) == len(set(ids)), "a node is drawn twice"
    return dict(zip(ids, groups))


def classes(g: ET.Element) -> set[str]:
    return set(g.get("class").split())


def texts(g: ET.Element) -> list[str]:
    return [t.text for t in g.iter(f"{SVG}text")]


# root 0 -> {1, 2}; 1 -> {3}; 2 -> {4, 5}; node 6 is padding. Accepted path 0 -> 2 -> 5, bonus 99.
RECORD = StepRecord(
    request_id=0, step=2,
    tree={"tokens": [10, 11, 12, 13, 14, 15, 0], "parents": [-1, 0, 0, 1, 2, 2, 0],
          "depth": [0, 1, 1, 2, 2, 2, 1], "scores": [1.0, 0.6, 0.4, 0.3, 0.1, 0.3, 0.0],
          "valid": [True] * 6 + [False]},
    accepted=[0, 2, 5], bonus_token=99, kept=3, timings={"draft": 0.002, "verify": 0.004})
TEXT = {10: "def", 11: " f", 12: "(x", 13: "\n", 14: "<&>", 15: "):", 99: " return"}.get


def test_every_valid_node_once_with_its_token_and_probability():
    nodes = nodes_of(render_tree(RECORD, TEXT))
    assert set(nodes) == {"0", "1", "2", "3", "4", "5", "bonus"}  # padding node 6 omitted
    expected = {"1": ("␣f", "0.60"), "2": ("(x", "0.40"), "3": ("↵", "0.50"), "4": ("<&>", "0.25"),
                "5": ("):", "0.75")}
    for node, (label, prob) in expected.items():
        assert texts(nodes[node]) == [label, prob]
    assert texts(nodes["0"]) == ["def", "root"]
    assert texts(nodes["bonus"]) == ["␣return", "bonus"]


def test_accepted_path_rejected_nodes_and_bonus_are_marked():
    svg = render_tree(RECORD, TEXT)
    nodes = nodes_of(svg)
    assert {n for n, g in nodes.items() if "accepted" in classes(g)} == {"0", "2", "5"}
    assert {n for n, g in nodes.items() if "rejected" in classes(g)} == {"1", "3", "4"}
    assert "root" in classes(nodes["0"]) and "bonus" in classes(nodes["bonus"])
    assert all(float(nodes[n].get("opacity")) < 1 for n in "134")
    assert all(float(nodes[n].get("opacity")) == 1 for n in ("0", "2", "5", "bonus"))
    edges = [e.get("class").split()[1] for e in ET.fromstring(svg).iter(f"{SVG}path")]
    assert sorted(edges) == ["accepted", "accepted", "bonus", "rejected", "rejected", "rejected"]


def test_bonus_hangs_off_the_last_accepted_node_and_the_path_is_the_top_row():
    """(a 63-node tree drew its accepted path wherever its ranks fell: often below the fold)"""
    nodes = nodes_of(render_tree(RECORD, TEXT))
    x = {n: float(g.find(f"{SVG}rect").get("x")) for n, g in nodes.items()}
    y = {n: float(g.find(f"{SVG}rect").get("y")) for n, g in nodes.items()}
    assert x["bonus"] > x["5"] > x["2"] > x["0"]
    assert x["3"] == x["4"] == x["5"]  # one column per depth
    assert y["0"] == y["2"] == y["5"] == y["bonus"] < y["4"] < y["1"] == y["3"]   # then index order


def test_rendering_is_deterministic_and_the_step_html_has_caption_and_tree():
    assert render_tree(RECORD, TEXT) == render_tree(RECORD, TEXT)
    html = render_step(RECORD, TEXT, num_steps=7)
    ET.fromstring(html)  # the whole step panel is well-formed too
    assert "Step 3 of 7" in html and "accepted 2 + bonus → 3 tokens <code>" in html and html.count("<svg") == 5
    assert "<code>(x):</code><code class='bonus'>␣return</code>" in html


def test_a_step_the_request_ended_inside_says_what_it_kept():
    """max_tokens (or an EOS, a stop) ended the request after the first accepted draft: the caption
    says 1 token kept, shows that token alone, no bonus."""
    html = render_step(dataclasses.replace(RECORD, kept=1), TEXT)
    assert "accepted 2 + bonus → 1 token (the request ended there: 2 not kept) <code>(x</code>" in html
    assert "class='bonus'" not in html.split("sf-caption")[1].split("</div>")[0]


def test_plain_decoding_step_is_the_root_and_its_bonus():
    record = StepRecord(0, 0, {"tokens": [7], "parents": [-1], "depth": [0], "scores": [1.0], "valid": [True]},
                        [0], 8, 1, {})
    nodes = nodes_of(render_tree(record))
    assert set(nodes) == {"0", "bonus"} and texts(nodes["bonus"]) == ["8", "bonus"]


def test_token_label_makes_whitespace_and_control_characters_visible():
    assert token_label(" a\tb\n") == "␣a⇥b↵"
    assert token_label("\x07") == "\\x07"
    assert token_label("") == "∅"
    assert token_label("abcdefghijkl") == "abcdefghi…"


@st.composite
def step_records(draw):
    """Random valid trees with trailing padding, a root-to-node accepted path and any token texts."""
    n_valid = draw(st.integers(1, 20))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n_valid)]
    n_pad = draw(st.integers(0, 4))
    depth, scores = [0], [1.0]
    for i in range(1, n_valid):
        depth.append(depth[parents[i]] + 1)
        scores.append(scores[parents[i]] * draw(st.floats(0.01, 1.0)))
    end = draw(st.integers(0, n_valid - 1))
    path = [end]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    tokens = draw(st.lists(st.integers(0, 30), min_size=n_valid, max_size=n_valid))
    tree = {"tokens": tokens + [0] * n_pad, "parents": parents + [0] * n_pad, "depth": depth + [1] * n_pad,
            "scores": scores + [0.0] * n_pad, "valid": [True] * n_valid + [False] * n_pad}
    texts = draw(st.lists(st.text(max_size=6), min_size=32, max_size=32))
    return StepRecord(0, 0, tree, path[::-1], draw(st.integers(0, 31)), len(path), {}), texts


@settings(max_examples=60, deadline=None)
@given(step_records())
def test_any_tree_renders_to_well_formed_svg_without_overlapping_boxes(case):
    record, names = case
    svg = render_tree(record, names.__getitem__)
    nodes = nodes_of(svg)
    n_valid = sum(record.tree["valid"])
    assert set(nodes) == {str(i) for i in range(n_valid)} | {"bonus"}
    probs = node_probs(record.tree)
    for i in range(1, n_valid):
        assert texts(nodes[str(i)]) == [token_label(names[record.tree["tokens"][i]]), f"{probs[i]:.2f}"]
    assert {n for n, g in nodes.items() if "accepted" in classes(g)} == {str(i) for i in record.accepted}
    top = min(float(g.find(f"{SVG}rect").get("y")) for g in nodes.values())
    assert {n for n, g in nodes.items() if float(g.find(f"{SVG}rect").get("y")) == top} == \
        {str(i) for i in record.accepted} | {"bonus"}
    boxes = sorted((float(g.find(f"{SVG}rect").get("x")), float(g.find(f"{SVG}rect").get("y")))
                   for g in nodes.values())
    for (x0, y0), (x1, y1) in zip(boxes, boxes[1:]):
        assert x0 != x1 or y1 - y0 >= BOX_H, "two boxes of one column overlap"


def test_a_small_q_is_not_shown_as_zero():
    """(sampled drafting draws tokens q gives 0.004 or less: "0.00" on an accepted node read as impossible)"""
    tree = {"tokens": [10, 11, 12], "parents": [-1, 0, 1], "depth": [0, 1, 2], "scores": [1.0, 0.0046, 0.0000138],
            "valid": [True] * 3}
    record = dataclasses.replace(RECORD, tree=tree, accepted=[0, 1, 2], kept=3)
    nodes = nodes_of(render_tree(record, TEXT))
    assert texts(nodes["1"])[1] == "0.005" and texts(nodes["2"])[1] == "0.003"


def test_the_q_of_a_deep_unlikely_node_survives_the_step_record():
    """(StepRecord scores were rounded to 6 decimals: a path probability under 5e-7 became 0 and the
    app drew q=0.00 for a drafted, even accepted, token; those above kept a digit or two, so q was off)"""
    import torch

    from specflow.tree import DraftTree

    scores = [1.0, 0.004572, 0.000875, 3.1e-6, 4.2e-9]   # a sampled chain: q 0.0046, 0.19, 0.0035, 0.0014
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7, 8, 9]]), parents=torch.tensor([[-1, 0, 1, 2, 3]]),
                     depth=torch.tensor([[0, 1, 2, 3, 4]]), positions=torch.tensor([[3, 4, 5, 6, 7]]),
                     scores=torch.tensor([scores]), valid=torch.ones(1, 5, dtype=torch.bool),
                     sampled=torch.ones(1, 5, dtype=torch.bool))
    probs = node_probs(tree.to_json()[0])
    for i in range(1, 5):
        assert abs(probs[i] - scores[i] / scores[i - 1]) <= 1e-4 * scores[i] / scores[i - 1]
