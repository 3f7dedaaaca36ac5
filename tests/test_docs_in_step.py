"""The documentation and the code in step, where a machine can check it: every option of every
strategy is described in its reference (the docstrings the API pages render) and in its page's
Options table with the code's default, every example config names only options that exist and says
what it claims, every error class the troubleshooting page names exists and every error the package
exports is explained there, every `lightning_prague.…` name and every tests/benchmarks/examples file
a page names exists, and every link into the docs from outside the site (README, messages,
docstrings, configs) points to a page and heading that exist. Links between pages are the strict
docs build's to check (`mkdocs build --strict`)."""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lightning_prague
from lightning_prague.core import errors
from lightning_prague.strategies.base import DecentralizedStrategy

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = [
    lightning_prague.PartialAllReduceStrategy,
    lightning_prague.PartialReduceStrategy,
    lightning_prague.ADPSGDStrategy,
    lightning_prague.DecentAdamStrategy,
]
#: arguments of DecentralizedStrategy that are Lightning's own DDPStrategy plugins (documented as such)
LIGHTNING_PLUGINS = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "start_method",
}


def options(cls: type) -> list[str]:
    """The keyword options `cls.__init__` declares itself (not `*args`, `**kwargs`)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def reference(cls: type) -> str:
    return (cls.__doc__ or "") + (cls.__init__.__doc__ or "")


@pytest.mark.parametrize("cls", [DecentralizedStrategy, *STRATEGIES], ids=lambda c: c.__name__)
def test_every_option_of_every_strategy_is_described_in_its_reference(cls):
    text = reference(cls)
    for name in options(cls):
        if name in LIGHTNING_PLUGINS:
            continue
        assert re.search(rf"`?{name}`?\s*[:(]", text) or f"`{name}`" in text, f"{cls.__name__}: {name} undocumented"
    assert "ddp_kwargs" not in options(cls) or "DDPStrategy" in reference(DecentralizedStrategy)


CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_names_only_options_that_exist(path):
    config = yaml.safe_load(path.read_text())
    strategy = config["trainer"]["strategy"]
    if isinstance(strategy, str):  # a registered name
        assert strategy in StrategyRegistry, f"{path.name}: {strategy} is not a registered strategy"
        return
    module, _, name = strategy["class_path"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    accepted = set(options(cls)) | set(options(DecentralizedStrategy))
    given = set(strategy.get("init_args", {}))
    assert given <= accepted, f"{path.name}: unknown options {sorted(given - accepted)} of {cls.__name__}"
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    if "every option" in header:  # the claim holds: every option of the strategy's own is spelled out
        own = options(cls)
        assert set(own) <= given, f"{path.name} claims every option but omits {sorted(set(own) - given)}"


def test_every_error_class_the_troubleshooting_page_names_exists():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    named = set(
        re.findall(r"`(?:lightning_prague\.)?([A-Z][A-Za-z]+(?:Error|Timeout|Lost|Failure|Interrupted))`", text)
    )
    assert named, "the page names error classes"
    for name in sorted(named):
        exists = hasattr(errors, name) or hasattr(lightning_prague, name) or hasattr(builtins, name)
        assert exists, f"troubleshooting.md names {name}, which does not exist"


# -- the user guide's pages against the code ------------------------------------------------------

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
STRATEGY_PAGES = {
    lightning_prague.PartialAllReduceStrategy: "prague.md",
    lightning_prague.PartialReduceStrategy: "partial_reduce.md",
    lightning_prague.ADPSGDStrategy: "adpsgd.md",
    lightning_prague.DecentAdamStrategy: "decent_adam.md",
}


def options_table(page: str) -> dict[str, str]:
    """`| option | default | meaning |` rows of a page's `## Options` section: name -> default cell."""
    text = (DOCS / page).read_text()
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", section, flags=re.MULTILINE)
    return {name: cell.strip() for name, cell in rows}


def literal(cell: str) -> object:
    """A default as the page writes it (`3`, `true`, `None`, `` `random` ``), or `...` for prose."""
    text = cell.strip("` ")
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    return text if re.fullmatch(r"[a-z_]+", text) else ...


@pytest.mark.parametrize("cls", list(STRATEGY_PAGES), ids=lambda c: c.__name__)
def test_every_strategy_page_lists_every_option_of_its_own_with_the_codes_default(cls):
    page = STRATEGY_PAGES[cls]
    table = options_table(page)
    defaults = {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()}
    for name in options(cls):
        assert name in table, f"docs/{page}: option {name} missing from its Options table"
        written = literal(table[name])
        if written is not ...:  # prose such as "devices per node" is not compared
            assert written == defaults[name], f"docs/{page}: {name} default {table[name]!r}, code {defaults[name]!r}"


def test_every_dotted_name_of_the_package_that_the_docs_name_exists():
    """`lightning_prague.x.y` in backticks on any page resolves to a module or an attribute."""
    import importlib

    missing = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"`(lightning_prague(?:\.\w+)+)", page.read_text()))):
            parts = name.split(".")
            obj, i = None, len(parts)
            while i > 0:  # the longest importable prefix, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    i -= 1
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "names the docs use that the package does not have:\n" + "\n".join(missing)


def test_every_test_benchmark_and_example_file_the_docs_name_exists():
    """`tests/...py`, `benchmarks/...py`, `examples/...` (and `file.py::function`) on any page exist."""
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path, function in re.findall(r"\b((?:tests|benchmarks|examples)/[\w/.-]+\.(?:py|yaml))(?:::(\w+))?", text):
            target = ROOT / path
            if not target.is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
            elif function and not re.search(rf"^def {function}\(", target.read_text(), flags=re.MULTILINE):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{function}")
    assert not missing, "files the docs name that do not exist:\n" + "\n".join(missing)


def slug(heading: str) -> str:
    """The anchor MkDocs' table of contents gives a heading (Python-Markdown's default slugify)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"[`*]", "", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)  # not code blocks
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.MULTILINE):
        explicit = re.search(r"\{#([\w-]+)\}$", heading)
        base = explicit.group(1) if explicit else slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if not count else f"{base}_{count}")
    return found


def test_every_docs_link_outside_the_site_points_to_a_page_and_heading_that_exist():
    """The strict docs build checks links between pages; this checks the links into the docs from
    the README, the package (messages, docstrings), the examples, the tests and the benchmarks."""
    sources = [ROOT / "README.md", *ROOT.glob("examples/**/*.py"), *ROOT.glob("examples/**/*.yaml")]
    for folder in ("lightning_prague", "tests", "benchmarks"):
        sources += ROOT.glob(f"{folder}/**/*.py")
    broken = []
    for source in sources:
        for page, anchor in re.findall(r"\bdocs/([\w/.-]+\.md)(?:#([\w-]+))?", source.read_text()):
            target = DOCS / page
            if not target.is_file():
                broken.append(f"{source.relative_to(ROOT)}: docs/{page}")
            elif anchor and anchor not in anchors(target):
                broken.append(f"{source.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert not broken, "links into the docs that lead nowhere:\n" + "\n".join(broken)


def test_every_error_the_package_exports_is_explained_on_the_troubleshooting_page():
    text = (DOCS / "troubleshooting.md").read_text()
    exported = [name for name in lightning_prague.__all__ if isinstance(getattr(lightning_prague, name), type)]
    errors_ = [name for name in exported if issubclass(getattr(lightning_prague, name), BaseException)]
    assert "ControlPlaneError" in errors_, "the package exports its errors"
    for name in errors_:
        assert re.search(rf"`(?:lightning_prague\.)?{name}`", text), f"troubleshooting.md does not explain {name}"


def _warning_messages() -> list[tuple[str, str]]:
    """(where, the longest literal piece of its message) for every `warnings.warn` / `rank_zero_warn`
    call in the package."""
    found = []
    for path in sorted((ROOT / "lightning_prague").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in ("warn", "rank_zero_warn"):
                continue
            message = node.args[0]
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            pieces = [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            if pieces:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", max(pieces, key=len)))
    return found


def test_every_warning_the_package_emits_is_listed_on_the_troubleshooting_page():
    page = " ".join((DOCS / "troubleshooting.md").read_text().split())
    messages = _warning_messages()
    assert len(messages) >= 4, messages  # the scan finds the package's warnings
    for where, piece in messages:  # its opening: the page may abridge the rest with "..."
        opening = " ".join(piece.split()).strip(" ;:,.")[:35]
        assert opening in page, f"troubleshooting.md does not list the warning at {where} ({opening!r}...)"


def _shared_options() -> list[str]:
    return [name for name in options(DecentralizedStrategy) if name not in LIGHTNING_PLUGINS]


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_every_strategy_names_every_shared_option_where_it_points_to_them(cls):
    kwargs = " ".join((cls.__doc__ or "").split("**kwargs:", 1)[-1].split("see `DecentralizedStrategy`")[0].split())
    missing = [name for name in _shared_options() if f"`{name}`" not in kwargs]
    assert not missing, f"{cls.__name__}'s **kwargs entry does not name {missing}"


def test_the_readme_names_every_shared_option():
    line = " ".join(
        (ROOT / "README.md").read_text().split("Options every strategy shares:", 1)[1].split("\n- ")[0].split()
    )
    missing = [name for name in _shared_options() if f"`{name}`" not in line]
    assert not missing, f"README.md's list of the shared options misses {missing}"


def test_the_pages_quote_the_control_plane_connection_error_as_the_code_words_it():
    """A rank that cannot reach the control plane fails with `ControlClient`'s message, which names
    the address once (its link's peer, "the control plane at HOST:PORT", already holds it): the pages
    quote it so."""
    import socket

    from lightning_prague.core import ControlClient
    from lightning_prague.core.auth import Credentials
    from lightning_prague.core.errors import CoordinationTimeout

    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(CoordinationTimeout) as caught:
        ControlClient("127.0.0.1", port, 7, timeout=2.0, credentials=Credentials.derive(b"secret", "launch"))
    message = str(caught.value).replace(f"127.0.0.1:{port}", "HOST:PORT").replace("rank 7", "rank R")
    quoted = re.sub(r" \([^()]*\)$", " (...)", message)  # the OS's reason, abridged
    assert quoted == "rank R: cannot connect to the control plane at HOST:PORT (...)", message
    for page in ("troubleshooting.md", "multi_node.md"):
        assert quoted in " ".join((DOCS / page).read_text().split()), f"docs/{page} does not quote {quoted!r}"


def test_every_snippet_line_of_the_docs_is_one_that_the_snippets_extension_includes():
    """pymdownx.snippets' `check_paths` fails the build for a marker whose file is missing, but a line
    it does not recognise as a marker is rendered as text, and the strict build passes. So every line
    that looks like a marker (`--8<--`, however spaced) must be one it recognises, naming a file that
    exists. In a Python fence the marker line is also valid Python, which `ruff format` rewrites
    (`--8 < --"..."`): such a fence must sit between `<!-- fmt: off -->` and `<!-- fmt: on -->`."""
    from pymdownx.snippets import SnippetPreprocessor

    looks_like = re.compile(r"^\s*-+\s*8\s*<\s*-+")
    bad = []
    for page in PAGES:
        guarded = False
        fence = None
        for number, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{number}"
            stripped = line.strip()
            if stripped in ("<!-- fmt: off -->", "<!-- fmt: on -->"):
                guarded = stripped == "<!-- fmt: off -->"
            elif stripped.startswith("```"):
                fence = None if fence is not None else stripped[3:].strip().lower()
            if not looks_like.match(line):
                continue
            marker = SnippetPreprocessor.RE_ALL_SNIPPETS.match(line)
            if marker is None:
                bad.append(f"{where}: not a snippet marker: {stripped!r}")
                continue
            if marker.group("snippet"):
                path = marker.group("snippet")[1:-1]
                if not (ROOT / path).is_file():
                    bad.append(f"{where}: {path} does not exist")
            if fence in ("python", "py", "python3") and not guarded:
                bad.append(f"{where}: a marker in a Python fence without <!-- fmt: off --> (ruff format rewrites it)")
    assert not bad, "snippet lines the docs build would not include:\n" + "\n".join(bad)
