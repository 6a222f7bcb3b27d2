#!/usr/bin/env python3
"""The docs stay true to the tree (ctest docs_links):

1. every relative link in README.md, docs/*.md and perf_tests/*.md (and the
   Markdown files under perf_tests/) resolves to a file or folder of the repository,
   and every `#anchor` to a heading of the Markdown file it points into (GitHub's
   anchors: the heading's text lower-cased, punctuation dropped, spaces turned into
   '-', a repeated heading suffixed -1, -2, ...);
2. every source file under src/ (.cpp and .hpp, impl/ folders included) has a row in
   docs/architecture.md's file table, and every file a row names exists.

Exit 1 naming each broken link and each missing or stale row. Only the Python
standard library. `--self-test` checks on a planted tree that the checker finds a
broken link, a broken anchor, a missing row and a stale row."""
import os
import re
import sys
import tempfile
import unicodedata

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target "title") -- the text may wrap over lines; images too (![alt](src)).
INLINE_LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def blank_code(text):
    """The text with fenced code blocks and inline code spans blanked (same length
    and line breaks), so nothing inside code counts as a link or a heading."""
    lines, out, fence = text.split("\n"), [], None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append(" " * len(line))
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append(" " * len(line))
        else:
            out.append(line)
    text = "\n".join(out)
    return CODE_SPAN.sub(lambda m: "`" + re.sub(r"[^\n]", "x", m.group(2)) + "`", text)


def slug(heading):
    """GitHub's anchor of a heading's text (github-slugger)."""
    text = INLINE_LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


_anchor_cache = {}


def anchors(path):
    """The anchors of a Markdown file's headings (and explicit <a name/id>)."""
    if path not in _anchor_cache:
        with open(path, encoding="utf-8") as fh:
            raw = fh.read()
        found, counts = set(), {}
        in_fence = None
        for line in raw.split("\n"):
            m = FENCE.match(line)
            if in_fence is None and m:
                in_fence = m.group(1)
                continue
            if in_fence is not None:
                if line.strip().startswith(in_fence):
                    in_fence = None
                continue
            h = HEADING.match(line)
            if h:
                base = slug(h.group(2))
                n = counts.get(base, 0)
                counts[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        found.update(HTML_ANCHOR.findall(raw))
        _anchor_cache[path] = found
    return _anchor_cache[path]


def markdown_files(root):
    files = [os.path.join(root, "README.md")]
    for folder in ("docs", "perf_tests"):
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".md")]
    return [f for f in files if os.path.isfile(f)]


def check_links(root):
    bad = []
    for md in markdown_files(root):
        with open(md, encoding="utf-8") as fh:
            raw = fh.read()
        text = blank_code(raw)
        targets = [(m.start(), m.group(2)) for m in INLINE_LINK.finditer(text)]
        targets += [(m.start(), m.group(1)) for m in REF_DEF.finditer(text)]
        for pos, target in sorted(targets):
            where = f"{os.path.relpath(md, root)}:{text.count(chr(10), 0, pos) + 1}"
            if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # http:, https:, mailto: ... are not checked here
            path, _, anchor = target.partition("#")
            dest = md if not path else os.path.normpath(os.path.join(os.path.dirname(md), path))
            if not os.path.exists(dest):
                bad.append(f"{where}: link to '{target}': no such file")
                continue
            if not os.path.realpath(dest).startswith(os.path.realpath(root) + os.sep):
                bad.append(f"{where}: link to '{target}' leaves the repository")
                continue
            if anchor and dest.endswith(".md") and anchor not in anchors(dest):
                bad.append(f"{where}: link to '{target}': {os.path.relpath(dest, root)} has no heading "
                           f"with anchor '#{anchor}'")
    return bad


def file_table_rows(arch):
    """The paths named in the first column of architecture.md's file table, with
    {hpp,cpp} expanded: relative to src/ash/, or to the repository when they start
    with src/."""
    with open(arch, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    rows, in_table = [], False
    for line in lines:
        if re.match(r"^\|\s*file\s*\|", line):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cell = line.split("|")[1]
            if re.match(r"^\s*-+\s*$", cell):
                continue
            for span in re.findall(r"`([^`]+)`", cell):
                m = re.match(r"^(.*)\{([^}]*)\}(.*)$", span)
                names = [m.group(1) + alt + m.group(3) for alt in m.group(2).split(",")] if m else [span]
                for n in names:
                    rows.append(os.path.normpath(n if n.startswith("src/") else os.path.join("src/ash", n)))
    return rows


def check_file_table(root):
    arch = os.path.join(root, "docs", "architecture.md")
    listed = file_table_rows(arch)
    if not listed:
        return ["docs/architecture.md: no file table (a table whose first column is 'file')"]
    sources = set()
    for dirpath, _, names in os.walk(os.path.join(root, "src")):
        for n in names:
            if n.endswith((".cpp", ".hpp")):
                sources.add(os.path.relpath(os.path.join(dirpath, n), root))
    bad = [f"docs/architecture.md: the file table has no row for {s}" for s in sorted(sources - set(listed))]
    bad += [f"docs/architecture.md: the file table names {p}, which does not exist"
            for p in sorted(set(listed) - sources)]
    return bad


def main(root):
    bad = check_links(root) + check_file_table(root)
    for b in bad:
        print(b)
    print(f"{len(markdown_files(root))} Markdown files and the file table checked: {len(bad)} problem(s)")
    return 1 if bad else 0


def self_test():
    """The checker on a planted tree: each kind of drift is found."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        os.makedirs(os.path.join(root, "src", "ash", "core", "impl"))
        for f in ("core/a.hpp", "core/a.cpp", "core/impl/b.hpp"):
            open(os.path.join(root, "src", "ash", f), "w").close()
        open(os.path.join(root, "src", "main.cpp"), "w").close()

        def write(path, text):
            with open(os.path.join(root, path), "w", encoding="utf-8") as fh:
                fh.write(text)

        write("docs/architecture.md", "# Architecture\n\n## The files: `src/ash/` (E4, §2)\n\n| file | what |\n"
              "|---|---|\n| `core/a.{hpp,cpp}` | a |\n| `core/impl/b.hpp` | b |\n| `src/main.cpp` | the tool |\n")
        good = ("# Project\n\nSee [the files](docs/architecture.md#the-files-srcash-e4-2) and\n"
                "[the\nintro](#project), [`code`](docs/architecture.md).\n\n```\n[not a link](nowhere.md)\n```\n"
                "`[not a link either](nowhere.md)`\n")
        write("README.md", good)
        if main(root) != 0:
            print("self-test: a correct tree was reported")
            return 1
        expected = {
            "no such file": good + "[broken](docs/nowhere.md)\n",
            "has no heading with anchor '#the-file'": good + "[broken](docs/architecture.md#the-file)\n",
            "has no heading with anchor '#intro'": good + "[broken](#intro)\n",
        }
        failures = 0
        for needle, text in expected.items():
            write("README.md", text)
            found = check_links(root)
            if not any(needle in b for b in found):
                print(f"self-test: '{needle}' not reported: {found}")
                failures += 1
        write("README.md", good)
        open(os.path.join(root, "src", "ash", "core", "c.hpp"), "w").close()
        if check_file_table(root) != ["docs/architecture.md: the file table has no row for src/ash/core/c.hpp"]:
            print(f"self-test: the missing row was not reported: {check_file_table(root)}")
            failures += 1
        os.remove(os.path.join(root, "src", "ash", "core", "c.hpp"))
        os.remove(os.path.join(root, "src", "ash", "core", "impl", "b.hpp"))
        if check_file_table(root) != ["docs/architecture.md: the file table names src/ash/core/impl/b.hpp, "
                                      "which does not exist"]:
            print(f"self-test: the stale row was not reported: {check_file_table(root)}")
            failures += 1
        print(f"self-test: {failures} failure(s)")
        return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
