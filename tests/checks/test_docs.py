"""The documentation as a reader follows it: every relative link of README.md and docs/
reaches a file of the repository, and every `#anchor` a heading (or an `<a id>`) of the page
it names, by GitHub's rules for heading anchors; the README stays short, and the commands
it shows are the ones the docs pin (tests/e2e/test_quickstart.py runs those).

No network: links to other sites are not followed."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^ *(```+|~~~+)")


def outside_fences(text: str) -> list[tuple[int, str]]:
    """The lines of a Markdown text outside fenced code blocks, numbered from 1."""
    lines, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip() == fence:
                fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks with inline code spans blanked (a link inside
    them is not one)."""
    return [(number, re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line))
            for number, line in outside_fences(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (links by their text, tags and
    emphasis marks gone), lowercased, every character but letters, marks, digits, connector
    punctuation (`_`), spaces and `-` removed, spaces made `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page: its headings' slugs, a repeated one numbered `-1`, `-2`… as
    GitHub numbers them, and the ids of its `<a id="…">` / `<a name="…">` tags."""
    found, seen = set(), {}
    for _, line in outside_fences(path.read_text()):
        heading = re.match(r"^#{1,6} +(.*?)(?: +#+)? *$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?: +\"[^\"]*\")?\)")


def links(path: Path) -> list[tuple[int, str]]:
    """The inline links and images of a page outside code: (line, target)."""
    return [(number, m.group(1)) for number, line in prose(path.read_text()) for m in LINK.finditer(line)]


def broken(path: Path) -> list[str]:
    """What in `path` does not resolve: a relative link to no file, an anchor no heading has."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: another site
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            if destination.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
                continue
            known = cache.setdefault(destination, anchors(destination))
            if anchor not in known:
                problems.append(f"{where}: {destination.relative_to(ROOT)} has no heading #{anchor}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [problem for page in PAGES for problem in broken(page)]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    """The check above can fail: a missing file, a missing anchor, a repeated heading's
    numbering, and what is inside code is not a link."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Twice\n\n## Twice\n\n## `store`: where `a_b` lives\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#twice-1) [ok](other.md#store-where-a_b-lives) [ok](#page)\n"
        "[missing](nowhere.md) [bad anchor](other.md#twice-2) [bad here](#nothing)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = broken(page)
    finally:
        ROOT = saved
    assert [p.split(": ")[1] for p in problems] == ["nowhere.md", "other.md#twice-2", "#nothing"], problems


def test_anchors_follow_githubs_rules():
    assert slug("Every request is 200 with `x-llm-ratelimit-degraded: local`") == \
        "every-request-is-200-with-x-llm-ratelimit-degraded-local"
    assert slug("Listening to the provider: its own limits (`provider_limits`)") == \
        "listening-to-the-provider-its-own-limits-provider_limits"
    assert slug("401 on routes that carry no API key (health checks, `/v1/models`)") == \
        "401-on-routes-that-carry-no-api-key-health-checks-v1models"
    assert slug("Shared pools: teams, organisations, the upstream's quota") == \
        "shared-pools-teams-organisations-the-upstreams-quota"


def test_every_doc_page_is_reachable_from_the_readme():
    """A page no link reaches is a page no reader finds: each is linked from the README or
    from a page the README links to, and so on."""
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            file_part = target.partition("#")[0]
            if not file_part or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            destination = (page.parent / file_part).resolve()
            if destination.suffix == ".md" and destination.exists() and destination not in reached:
                reached.add(destination)
                todo.append(destination)
    unreached = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in reached]
    assert not unreached, f"no link from the README leads to {unreached}"


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: the reference belongs in docs/"


def test_the_readmes_commands_are_the_pinned_ones():
    """Every shell block of the README is word for word in a page of docs/ (where
    tests/e2e/test_quickstart.py finds and runs the quick start's), so the two cannot drift."""
    docs = "\n".join(page.read_text() for page in PAGES[1:])
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.S | re.M)
    assert blocks, "the README shows no commands"
    for block in blocks:
        for line in block.strip().split("\n"):
            assert line.strip() in docs, f"the README's `{line.strip()}` is in no page of docs/"
