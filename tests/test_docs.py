"""The README and docs/: links that resolve, a README that stays short, and examples in it that really work.

* every relative link in README.md, CONTRIBUTING.md and docs/*.md (inline `[text](target)`, reference definitions
  `[name]: target`, images) points at a file or folder that exists, and a `#fragment` at a heading of the target
  page (GitHub's anchor rule); links inside code blocks and HTML comments are not links and are skipped;
* every page in docs/ is reached from the README by following links (a page nobody can find is lost);
* README.md is at most 260 lines;
* the README's test command is the line .ci/run runs;
* the README's example data rows load with the real loader, its example reward function and YAML run in the real
  reward worker, and its "Open in Colab" links and the notebooks' install cells name one repository;
* notebooks/ is stored without outputs.
Rows marked by an HTML comment holding "PLACEHOLDER" right before their code block wait for another branch and
are skipped until the lead removes the comment.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 260
PAGES = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text that renders as prose: code blocks, HTML comments and inline code blanked out."""
    text = FENCE.sub("", text)
    text = COMMENT.sub("", text)
    return INLINE_CODE.sub("``", text)


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REF_DEF.findall(prose)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    h = h.replace("`", "").lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("", page.read_text())):
        a = _anchor(h)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in _links(page.read_text()):
        if _is_external(target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if path and (dest == REPO or REPO not in dest.parents) and dest != REPO:
            bad.append(f"{target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            bad.append(f"{target} (no heading #{fragment} in {dest.relative_to(REPO)})")
    return bad


# -- the checker itself --------------------------------------------------------------------------------------------

def test_link_checker_finds_broken_links_and_ignores_code(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code`, here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok anchor](docs/a.md#some-code-here) [self](#top-title) ![img](docs/a.md)\n"
        "[missing](docs/b.md) [bad anchor](docs/a.md#nope) [web](https://example.com/x) `[code](nope.md)`\n"
        "[ref]: docs/gone.md\n<!-- [hidden](hidden.md) -->\n```\n[fenced](fenced.md)\n```\n# Top title\n")
    assert broken_links(page) == ["docs/b.md (no such file)", "docs/a.md#nope (no heading #nope in docs/a.md)",
                                  "docs/gone.md (no such file)"]


# -- the pages -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def reachable_pages(start: Path) -> set[Path]:
    """The markdown pages reached from `start` by following relative links, page by page."""
    seen, todo = {start.resolve()}, [start.resolve()]
    while todo:
        page = todo.pop()
        for t in _links(page.read_text()):
            target = (page.parent / t.partition("#")[0]).resolve()
            if not _is_external(t) and target.suffix == ".md" and target.is_file() and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_docs_page_is_reached_from_the_readme():
    linked = reachable_pages(README)
    orphans = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert orphans == [], f"docs pages no link from the README leads to: {orphans} (add them to its 'Read more' " \
                          f"list, or link them from a page it links)"


def test_reachable_pages_follow_links_through_pages(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[a](docs/a.md)\n")
    (tmp_path / "docs" / "a.md").write_text("[b](b.md#x) [web](https://example.com/c.md)\n")
    (tmp_path / "docs" / "b.md").write_text("[back](../README.md)\n")
    (tmp_path / "docs" / "orphan.md").write_text("[a](a.md)\n")
    assert {p.name for p in reachable_pages(tmp_path / "README.md")} == {"README.md", "a.md", "b.md"}


def test_readme_stays_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_readme_test_command_is_what_ci_runs():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    tests = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert tests == ["pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, ".ci/run must run the README's test command verbatim"


# -- the README's examples -----------------------------------------------------------------------------------------

def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str, lang: str) -> list[str]:
    """Code blocks of one language, except those right after an HTML comment that says PLACEHOLDER."""
    out = []
    for m in re.finditer(rf"```{lang}\n(.*?)```", section, re.S):
        before = section[:m.start()].rstrip()
        if before.endswith("-->") and "PLACEHOLDER" in before[before.rfind("<!--"):]:
            continue
        out.append(m.group(1))
    return out


def test_readme_data_examples_load(tmp_path):
    from basis_lite.config import DataConfig
    from basis_lite.data import load_examples

    section = _section("Your own data and rewards")
    files = []
    for lang, suffix in (("jsonl", ".jsonl"), ("json", ".json"), ("csv", ".csv")):
        for i, block in enumerate(_blocks(section, lang)):
            files.append((tmp_path / f"{lang}{i}{suffix}", block))
    assert {f.suffix for f, _ in files} == {".jsonl", ".json", ".csv"}, "one example row per file format"
    for path, block in files:
        path.write_text(block)
        examples = load_examples(DataConfig(dataset=str(path), eval_size=0, max_bad_fraction=0.0), "train")
        assert len(examples) >= 1 and all(ex.question and ex.answer for ex in examples), block
    # the field names the README states are the defaults
    assert "**`question`** and **`answer`**" in section
    assert (DataConfig().question_field, DataConfig().answer_field) == ("question", "answer")


def test_readme_reward_example_runs_in_the_reward_worker(tmp_path, monkeypatch):
    from basis_lite.config import load_config
    from basis_lite.rewards.scorer import RewardScorer

    section = _section("Your own data and rewards")
    (code,) = _blocks(section, "python")
    (conf,) = _blocks(section, "yaml")
    module = re.match(r"# (\w+)\.py\n", code).group(1)
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.chdir(tmp_path)  # "a module in the folder you run from"
    cfg = load_config("smoke", overrides=[f"reward.{k}={json.dumps(v)}" for k, v in yaml.safe_load(conf)["reward"].items()])
    with RewardScorer(cfg.reward) as score:
        rb = score(["q", "q"], ["\\boxed{4}", "x" * 300], ["4", "4"])
    assert rb.warnings == 0
    assert rb.per_function == {f"{module}:short_answer": [1.0, 0.0]}
    assert rb.total == pytest.approx([1.0 + 0.1, 0.0])


def test_colab_links_and_notebook_installs_name_one_repository():
    readme = README.read_text()
    colab = set(re.findall(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/main/(notebooks/[\w.-]+)", readme))
    assert colab, "the README has no Open-in-Colab link"
    for _, nb in colab:
        assert (REPO / nb).is_file(), nb
    repos = {r for r, _ in colab}
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        repos |= set(re.findall(r"github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?[\"'/@ ]", nb.read_text()))
    assert len(repos) == 1, f"the README and the notebooks name different repositories: {sorted(repos)}"


@pytest.mark.parametrize("nb", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(nb):
    cells = json.loads(nb.read_text())["cells"]
    assert sum("parameters" in c.get("metadata", {}).get("tags", []) for c in cells) == 1
    dirty = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert dirty == [], f"{nb.name}: clear the outputs of cells {dirty} before committing"
