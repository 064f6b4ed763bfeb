"""Wait for a SpecServe endpoint to be healthy, then answer one request with `openai`.

Used by ``make serve``: ``python -m deployments.smoke --url http://127.0.0.1:8000``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

DEMO_PROMPT = (
    "class Point:\n"
    "    def __init__(self, x, y):\n"
    "        self.x = x\n"
    "        self.y = y\n"
    "\n"
    "    def __repr__(self):\n"
    "        return"
)


def wait_healthy(url: str, timeout_s: float) -> dict:
    """``/health``'s body once it says ok; a TimeoutError naming the last state after
    ``timeout_s`` (``main`` exits with it; the client tests' fixture fails with it)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    said = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                body = json.load(resp)
                if body.get("status") == "ok":
                    return body
                last = json.dumps(body)
                if body.get("status") == "warming" and said != "warming":
                    said = "warming"  # the first start compiles; a restart reads the cache
                    print("warming up: compiling the models' graphs (see the replica's log)")
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read().decode()[:200]}"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = str(exc)
        time.sleep(1)
    raise TimeoutError(f"SpecServe at {url} was not healthy after {timeout_s:.0f}s: {last}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deployments.smoke")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout", type=float, default=300)
    # What the demo pair is good at: Python in the standard library's style, continued
    # mid-method (a 9 M-parameter model trained for minutes on a CPU; see models/README.md).
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    args = parser.parse_args()

    from openai import OpenAI

    t0 = time.monotonic()
    try:
        wait_healthy(args.url, args.timeout)
    except TimeoutError as exc:
        raise SystemExit(str(exc)) from None
    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=args.prompt, max_tokens=32, temperature=0)
    print(f"healthy after {time.monotonic() - t0:.1f}s; model {model!r}")
    print("--- prompt ---")
    print(args.prompt, end="")
    print("--- completion ---")
    print(resp.choices[0].text)
    print("--- speculation ---")
    print(json.dumps(resp.model_extra.get("speculation"), indent=2))
    print(f"--- use it ---\nOpenAI-compatible API at {args.url}/v1 (model {model!r})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
