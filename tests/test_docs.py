"""The README as a front page and the documentation site (mkdocs.yml, docs/): the site builds strict and offline, its
generated reference holds every command's --help and every metric's direction, its pages load in headless Chromium
without a console error or a request off the machine, its search finds what a newcomer looks for, and the
tutorial's commands run."""
from __future__ import annotations

import functools
import html
import http.server
import json
import re
import shlex
import threading
from pathlib import Path

import pandas as pd
import pytest
from conftest import _load_example, headless_chromium, make_corpus, run_cli, train_sweep

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
pytest.importorskip("mkdocs", reason="the docs tools are in the [dev] extra: pip install -e '.[dev]'")


def text_of(page: Path) -> str:
    """A built page's text: tags stripped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as .ci/run builds it: strict (a warning, such as a broken link, fails), offline."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))
    return out


# ---------------------------------------------------------------- the README


def test_the_readme_is_a_front_page_whose_setup_is_what_ci_runs():
    """<= 250 lines and <= 25 KB; its first section is the set-up and test commands, and .ci/run runs exactly
    those; every link into docs/ names a page that exists."""
    text = README.read_text()
    assert text.count("\n") <= 250 and len(text.encode()) <= 25_000
    first = re.search(r"^## ([^\n]+)\n+```bash\n(.*?)```", text, re.M | re.S)
    assert first.group(1) == "Set up and test"
    install, test = first.group(2).strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    assert [c.strip() for c in install.split("&&")] == ['pip install torch==2.13.0', 'pip install -e ".[dev]"']
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[dev]"' in ci and f"\n{test}\n" in ci
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), links


OTHER_TOOLS = {"--strict": "mkdocs build", "--safe_serialization": "zero_to_fp32.py", "--scheduler-file": "dask",
               "--resources": "dask worker", "--nthreads": "dask worker", "--bind": "mount", "--help": "every command"}


def test_the_benchmark_results_are_the_recorded_runs_and_a_run_records_itself(tmp_path, monkeypatch):
    """benchmarks/RESULTS.md is what record.py writes from benchmarks/results/ (never typed by hand), and the runner
    records a benchmark's output with the command that reproduces it (here a script of the test's own, in a copy)."""
    record = _load_example_module(ROOT / "benchmarks" / "record.py")
    assert re.fullmatch(r" at commit [0-9a-f]{7,}( \+ changes)?", record.commit())  # which code a record measured
    runs = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    assert runs and (ROOT / "benchmarks" / "RESULTS.md").read_text() == record.HEADER + "\n".join(
        p.read_text() for p in runs)
    copy = tmp_path / "benchmarks"
    (copy / "results").mkdir(parents=True)
    (copy / "toy.py").write_text("import sys\nprint('ratio', 0.5 * float(sys.argv[1]))\n")
    monkeypatch.setattr(record, "RESULTS", copy / "results")
    monkeypatch.setattr(record, "__file__", str(copy / "record.py"))
    monkeypatch.setattr("sys.argv", ["record.py"])
    record.main(["toy.py", "3"])
    text = (copy / "results" / "toy.md").read_text()
    assert text.startswith("### `python benchmarks/toy.py 3`") and "ratio 1.5" in text
    assert "at commit" not in text  # outside a git checkout: no commit said
    assert (copy / "RESULTS.md").read_text() == record.HEADER + text
    record.main(["--as", "toy-twice", "toy.py", "4"])  # a second mode of one script, kept beside the first
    twice = (copy / "results" / "toy-twice.md").read_text()
    assert twice.startswith("### `python benchmarks/toy.py 4`") and "ratio 2.0" in twice
    assert (copy / "results" / "toy.md").read_text() == text
    assert (copy / "RESULTS.md").read_text() == record.HEADER + twice + "\n" + text  # in name order
    with pytest.raises(SystemExit, match="no benchmark 'nope.py'"):
        record.main(["nope.py"])


def _load_example_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_flag_the_pages_name_is_an_option_of_a_command():
    """A flag the hand-written pages or the README mention is an option of an ncanalyze command, of the example
    scripts (the tutorial's training, the worked study's recipe), or of another tool named here: a renamed or removed
    option cannot linger in the prose."""
    from ncanalyze.cli.main import main

    ours = {o for c in [main, *main.commands.values()] for p in c.params for o in (*p.opts, *p.secondary_opts)}
    for script in (train_sweep, _load_example("recipe_cpu")):
        ours |= {o for a in script._parser()._actions for o in a.option_strings}
    for page in [README, *(ROOT / "docs").rglob("*.md")]:
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", page.read_text()))
        assert named <= ours | set(OTHER_TOOLS), (page.name, named - ours - set(OTHER_TOOLS))


# ---------------------------------------------------------------- the built site


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page_of_the_nav(site):
    """The fixture's strict build raised on any warning (a broken link or anchor, an API object not found); every
    page of the navigation is written, the generated ones with their generated parts."""
    import yaml

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from pages(value) if isinstance(value, list) else [value]

    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)["nav"]
    for md in pages(nav):
        built = site / ("" if md == "index.md" else md.removesuffix(".md")) / "index.html"
        assert built.is_file() and "-- ncanalyze:" not in built.read_text(), md  # every marker replaced


@pytest.mark.slow
def test_every_option_of_every_command_is_in_the_reference_as_help_prints_it(site):
    """The command reference is each command's --help, line for line, so every option is there."""
    from ncanalyze.cli.main import main

    page = text_of(site / "reference" / "cli" / "index.html")
    root = main.context_class(main, info_name="ncanalyze")
    for name, cmd in main.commands.items():
        ctx = cmd.context_class(cmd, info_name=name, parent=root, terminal_width=110, max_content_width=110)
        for line in cmd.get_help(ctx).splitlines():
            assert line.strip() in page, (name, line)
        flags = [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
        assert flags and all(re.search(rf"{re.escape(f)}\b", page) for f in flags), name


@pytest.mark.slow
def test_every_metric_card_says_which_way_is_more_collapse(site):
    """One card per metric record, each with its direction line (or the reason it has none) and its formula."""
    from ncanalyze.analyzer.metric_records import RECORDS

    page = text_of(site / "metrics" / "index.html")
    cards = re.split(r"\n(?=[a-z0-9_]+¶?\n)", page)
    for r in RECORDS:
        card = next(c for c in cards if c.startswith(r.name + "¶") or c.startswith(r.name + "\n"))
        assert f"Which way is more collapse: {r.direction_text}." in card, r.name
        assert r.function in card
    assert "higher is more collapse" in page and "not an NC property (no collapse direction)" in page


@pytest.mark.slow
def test_the_search_index_finds_what_a_newcomer_looks_for(site):
    index = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    for word in ("LoRA", "callback", "bootstrap"):
        assert any(word.lower() in (d["title"] + " " + d["text"]).lower() for d in index), word


@pytest.mark.slow
def test_the_results_page_is_the_committed_study(site):
    """The site's results are examples/results' findings and summary, included at build time (no copy)."""
    page = text_of(site / "reference" / "results" / "index.html")
    summary = (ROOT / "examples" / "results" / "summary.md").read_text()
    for row in [x for x in summary.splitlines() if x.startswith("| nc1_cdnv |")]:
        assert " ".join(row.strip("| ").split(" | ")) in " ".join(page.split()).replace(" | ", " ")
    assert (site / "results" / "all_fig1_nc_vs_loss.png").is_file()


# ---------------------------------------------------------------- in a browser



@pytest.fixture(scope="module")
def served(site):
    """The site on a local HTTP server (the search runs in a web worker, which a file: page may not start)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = headless_chromium(tmp_path_factory.mktemp("chromium-docs"))
    yield driver
    driver.quit()


def requests_sent(driver) -> list[str]:
    """The URLs the browser asked for since the last call."""
    sent = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    return [m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"]


@pytest.mark.slow
def test_every_page_loads_in_chromium_without_errors_or_requests_off_the_machine(site, served, browser):
    pages = sorted(p.relative_to(site).parent.as_posix() for p in site.rglob("index.html"))
    assert len(pages) >= 20
    for page in pages:
        browser.get_log("browser"), requests_sent(browser)
        browser.get(served + ("" if page == "." else page + "/"))
        browser.execute_script("return document.readyState")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, (page, errors)
        remote = [u for u in requests_sent(browser) if re.match(r"(https?|wss?|ftp):", u) and not u.startswith(served)]
        assert not remote, (page, remote)


@pytest.mark.slow
def test_the_search_box_finds_lora_callback_and_bootstrap(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for word in ("LoRA", "callback", "bootstrap"):
        browser.get(served)
        box = WebDriverWait(browser, 20).until(lambda d: d.find_element(By.CSS_SELECTOR, "input.md-search__input"))
        box.click()
        box.send_keys(word)
        found = WebDriverWait(browser, 20).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
        assert found, word
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


# ---------------------------------------------------------------- the tutorial


def tutorial_commands() -> tuple[list[str], str]:
    """The tutorial's shell commands (continuation lines joined) and its Python block, as the page holds them."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    block = page[page.index("<!-- tutorial:start -->"):page.index("<!-- tutorial:end -->")]
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", block, re.S)).replace("\\\n", " ")
    python = "\n".join(re.findall(r"```python\n(.*?)```", block, re.S))
    return [line for line in shell.splitlines() if line.strip()], python


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path, monkeypatch, capsys):
    """Each command of the tutorial, in order, in a fresh folder holding a text file: the training script (the
    stock Trainer), extract, report, then the Python block, whose numbers are metrics.csv's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NCANALYZE_STORE", raising=False)
    make_corpus(tmp_path / "train.txt", 1500, seed=1)
    make_corpus(tmp_path / "validation.txt", 200, seed=2)
    shell, python = tutorial_commands()
    assert [c.split()[:2] for c in shell] == [["python", "examples/train_sweep.py"], ["ncanalyze", "extract"],
                                              ["ncanalyze", "report"]]
    for command in shell:
        words = shlex.split(command)
        if words[0] == "python":
            assert train_sweep.main(words[2:]) == 0
        else:
            run_cli(*words[1:])
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "report.html").is_file()
    capsys.readouterr()
    exec(compile(python, "getting-started.md", "exec"), {})  # the page's own code, as a reader runs it
    printed = capsys.readouterr().out.splitlines()
    table = pd.read_csv(tmp_path / "report" / "metrics.csv").set_index("checkpoint")
    checkpoint = re.search(r'tree\["[^/]+/([^"]+)"\]', python).group(1)  # the one the block opens
    assert len(table) == 2 and float(printed[-2]) == pytest.approx(table.loc[checkpoint, "nc1_cdnv"], rel=1e-9)
    assert printed[-1].startswith(f"{int(table.loc[checkpoint, 'train_tokens'])} train tokens")
