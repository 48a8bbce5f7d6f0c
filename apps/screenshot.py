"""Screenshot the app after a real side-by-side generation (how docs/app.png is made):

    python apps/screenshot.py docs/app.png [CONFIG] [--prompt TEXT]

Launches the app on a free loopback port, drives Debian's chromium (``apt-get install chromium``;
no browser download) through Playwright, generates side by side with the app's two default
pipelines (CONFIG's first ones when given), optionally replays a step of each, and saves a
full-page screenshot.
"""

import argparse
import socket

from playwright.sync_api import sync_playwright

from specflow.app.ui import launch

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("config", nargs="?")
    parser.add_argument("--prompt")
    parser.add_argument("--step-a", type=int, help="replay this step of pipeline A (1-based) before the shot")
    parser.add_argument("--step-b", type=int, help="the same for pipeline B")
    args = parser.parse_args()
    port = free_port()
    demo = launch(args.config, port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            if args.prompt:
                page.locator("#prompt textarea").fill(args.prompt)
            page.locator("#side-by-side input").check()
            page.locator("#generate").click()
            page.wait_for_selector("#status [data-done='True']", timeout=300_000)
            for lane, step in (("a", args.step_a), ("b", args.step_b)):
                if step:
                    page.locator(f"#slider-{lane} input[type=number]").fill(str(step))
                    page.locator(f"#slider-{lane} input[type=number]").press("Enter")
                    page.wait_for_selector(f"#tree-{lane} svg[data-step='{step - 1}']")
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        demo.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
