"""The app in a real headless browser: Debian's chromium driven by Playwright (no browser download).

Generates with two pipelines side by side and checks that draft trees with an accepted path, the
bonus token and the speedup appear, that the step slider replays an earlier step, and that a
pipeline that cannot load shows a message instead of a traceback.
"""

import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the app extra is not installed: pip install 'specflow[app]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright Python package")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")

EXPERIMENT = """\
name: tiny
engine: {{target: {target}, device: cpu, dtype: float32, kv_cache_tokens: 2048}}
sampling: {{temperature: 0.0, max_tokens: 16, ignore_eos: true}}
pipelines:
  - name: self-chain
    drafter: {{type: draft_model, path: {target}, kv_cache_tokens: 2048}}
    tree: {{type: chain, depth: 3}}
    verifier: {{type: greedy}}
  - name: self-eagle2
    drafter: {{type: draft_model, path: {target}, kv_cache_tokens: 2048}}
    tree: {{type: eagle2, topk: 2, depth: 3, num_draft_tokens: 6}}
    verifier: {{type: rejection}}
"""
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def app_url(tiny_target, tmp_path_factory):
    """The app on a free loopback port; both pipelines draft with the target itself, so greedy drafts
    are right and every tree has a long accepted path."""
    from specflow.app.ui import launch

    config = tmp_path_factory.mktemp("app") / "tiny.yaml"
    config.write_text(EXPERIMENT.format(target=tiny_target))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = launch(config, port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url)
    yield page
    page.close()


def generate(page) -> None:
    page.locator("#generate").click()
    page.wait_for_selector("#status [data-done='True']", timeout=WAIT_MS)


def test_two_pipelines_side_by_side_draw_trees_with_accepted_paths(page, tmp_path):
    page.locator("#side-by-side input").check()
    generate(page)
    for lane, name in (("a", "tiny / self-chain"), ("b", "tiny / self-eagle2")):
        assert name in page.locator(f"#header-{lane}").inner_text()
        tree = page.locator(f"#tree-{lane} svg.draft-tree")
        assert tree.count() == 1
        assert tree.locator("g.node.accepted:not(.root)").count() >= 1   # drafts accepted beyond the root
        assert tree.locator("g.node.bonus").count() == 1
        assert tree.locator("path.edge.accepted").count() >= 1
        stats = page.locator(f"#stats-{lane}")
        assert "×" in stats.inner_text() and stats.locator("rect.bar").count() >= 2
        assert page.locator(f"#text-{lane} textarea").input_value()
    assert page.locator("#tree-b g.node.rejected").count() >= 1           # eagle2 keeps more than one branch
    page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
    assert (tmp_path / "app.png").stat().st_size > 10_000

    steps = page.locator("#slider-a input[type=number]")
    steps.fill("1")
    steps.press("Enter")
    page.wait_for_selector("#tree-a svg.draft-tree[data-step='0']", timeout=WAIT_MS)
    assert "Step 1 of" in page.locator("#tree-a").inner_text()


def test_a_pipeline_that_cannot_load_shows_a_message_not_a_traceback(page):
    params = page.locator("#drafter-params-a textarea")
    params.fill("{path: /nonexistent/draft}")
    generate(page)
    error = page.locator("#header-a .sf-error").inner_text()
    assert "does not exist" in error and "Traceback" not in page.content()


def test_the_same_pipeline_in_both_lanes_runs_twice(page):
    """(both lanes ran on one engine, each taking the other's finished request: a crash)"""
    page.locator("#side-by-side input").check()
    page.locator("#picker-b input").fill("tiny / self-chain")
    page.locator("#picker-b input").press("Enter")
    page.wait_for_function("document.querySelector('#tree-type-b input').value === 'chain'", timeout=WAIT_MS)
    generate(page)
    assert "A: done, B: done" in page.locator("#status").inner_text()
    for lane in "ab":   # the header names the pipeline and what ran
        assert page.locator(f"#header-{lane}").inner_text().startswith(f"{lane.upper()} · tiny / self-chain "
                                                                      "draft_model x chain x greedy")
    texts = [page.locator(f"#text-{lane} textarea").input_value() for lane in "ab"]
    assert texts[0] and texts[0] == texts[1]


def ask_for_512_tokens(page) -> None:
    """Set max_tokens to 512, until the slider itself holds it: a click on Generate sends the
    slider's value, and on loaded CI machines a fill right after the accordion opened was sometimes
    lost (a run went with the default 16 tokens; the slider never read 512)."""
    page.get_by_text("sampling", exact=True).click()   # (the accordion)
    number = page.locator("#max-tokens input[type=number]")
    for _ in range(20):
        number.fill("512")
        number.press("Enter")
        try:
            page.wait_for_function("document.querySelector('#max-tokens input[type=range]')?.value === '512'",
                                   timeout=2_000)
            return
        except sync_api.TimeoutError:
            pass
    raise AssertionError("the max_tokens slider never took 512")


@pytest.fixture
def paced(monkeypatch):
    """Engine steps at a larger model's pace (the app runs in this process), so that a long run
    outlasts what a test does during it: on a fast machine the tiny target's 128 steps once ended
    before a replayed step landed."""
    from specflow.app.session import Lane

    advance = Lane.advance
    monkeypatch.setattr(Lane, "advance", lambda lane: time.sleep(0.01) or advance(lane))


def start_a_long_run(page) -> None:
    """Generate 512 tokens and return once the run is under way."""
    ask_for_512_tokens(page)
    page.locator("#generate").click()
    page.wait_for_selector("#status:has-text('A: running')", timeout=WAIT_MS)


def test_stop_in_one_tab_leaves_another_tab_s_run_alone(browser, app_url):
    """Each browser session has its own Stop (one Event for all stopped every tab's run)."""
    running, other = browser.new_page(), browser.new_page()
    for p in (running, other):
        p.goto(app_url)
    start_a_long_run(running)
    other.locator("#stop").click()
    running.wait_for_selector("#status [data-done='True']", timeout=WAIT_MS)
    assert "A: done" in running.locator("#status").inner_text()
    for p in (running, other):
        p.close()


def test_stop_pressed_while_the_run_is_queued_stops_it(browser, app_url, paced):
    """A Stop pressed while a run waits behind another tab's holds when it starts (it was cleared
    as the run started)."""
    running, queued = browser.new_page(), browser.new_page()
    for p in (running, queued):
        p.goto(app_url)
    start_a_long_run(running)
    # (512 tokens here too: a short run could start, once the other tab's ended, and end before
    # the Stop reached the server, which then found no run to stop)
    ask_for_512_tokens(queued)
    # (the run joins the queue once Generate's own reset of Stop has returned: a Stop sent within
    # milliseconds of Generate could otherwise reach the server first and be cleared by it)
    with queued.expect_response(lambda r: "queue/join" in r.url, timeout=WAIT_MS):
        queued.locator("#generate").click()
    queued.locator("#stop").click()
    running.wait_for_selector("#status [data-done='True']", timeout=WAIT_MS)
    queued.wait_for_selector("#status [data-done='True']", timeout=WAIT_MS)
    assert "A: done" in running.locator("#status").inner_text()
    assert "A: stopped" in queued.locator("#status").inner_text()
    for p in (running, queued):
        p.close()


def test_a_run_without_lane_b_clears_what_lane_b_showed(page):
    """(lane B kept an earlier side-by-side run's text, tree and "done" under a later prompt it never ran)"""
    page.locator("#side-by-side input").check()
    generate(page)
    assert page.locator("#text-b textarea").input_value()
    page.locator("#side-by-side input").uncheck()
    page.locator("#prompt textarea").fill("while True:\n    ")
    page.locator("#generate").click()
    page.wait_for_function("document.querySelector('#status').innerText.trim() === 'A: done'", timeout=WAIT_MS)
    page.locator("#side-by-side input").check()
    page.wait_for_selector("#lane-b", state="visible")
    assert page.locator("#text-b textarea").input_value() == ""
    assert page.locator("#tree-b svg.draft-tree").count() == 0
    assert "done" not in page.locator("#stats-b").inner_text()


def test_plain_decoding_shows_only_the_drafter_field_and_runs(page):
    """(plain decoding showed a tree and a verifier it does not use; they come back with a drafter)"""
    page.locator("#picker-a input").fill("plain decoding")
    page.locator("#picker-a input").press("Enter")
    page.wait_for_selector("#tree-type-a", state="hidden", timeout=WAIT_MS)
    for field in ("verifier-type-a", "drafter-params-a", "depth-a", "tree-params-a"):
        assert not page.locator(f"#{field}").is_visible()
    generate(page)
    assert "A: done" in page.locator("#status").inner_text()
    assert "plain decoding" in page.locator("#header-a").inner_text()
    page.locator("#drafter-type-a input").fill("ngram")
    page.locator("#drafter-type-a input").press("Enter")
    page.wait_for_selector("#tree-type-a", state="visible", timeout=WAIT_MS)
    assert page.locator("#verifier-type-a").is_visible() and page.locator("#depth-a").is_visible()


def test_a_step_replayed_during_a_run_stays_shown_while_the_run_goes_on(page, paced):
    """(each frame of the run put the slider and tree back on the last step, under the user's drag)"""
    start_a_long_run(page)
    page.wait_for_function("Number(document.querySelector('#tree-a svg.draft-tree')?.dataset.step) >= 2",
                           timeout=WAIT_MS)
    steps, last = page.locator("#slider-a input[type=number]"), page.locator("#slider-a input[type=range]")
    steps.fill("1")
    steps.press("Enter")
    page.wait_for_selector("#tree-a svg.draft-tree[data-step='0']", timeout=WAIT_MS)
    pinned_at = int(last.get_attribute("max"))
    page.wait_for_selector("#status [data-done='True']", timeout=WAIT_MS)   # the run's frames, to its end
    assert int(last.get_attribute("max")) > pinned_at                      # (frames came after the pin)
    assert page.locator("#tree-a svg.draft-tree").get_attribute("data-step") == "0"
    assert steps.input_value() == "1"
    steps.fill(last.get_attribute("max"))
    steps.press("Enter")
    page.wait_for_selector(f"#tree-a svg.draft-tree[data-step='{int(last.get_attribute('max')) - 1}']",
                           timeout=WAIT_MS)
