#!/usr/bin/env python3
"""Resolve every relative link and anchor in README.md and docs/*.md.

usage: check_links.py SOURCE_DIR

A link to a file or directory must name one that exists in the source tree.
An anchor (#name), in the same page or in another .md page, must be one that
GitHub gives that page: each heading's slug (lower case, inline markup
dropped, every character but letters, digits, spaces, '-' and '_' dropped,
spaces turned to '-'; a repeated slug gets -1, -2, ...) or an explicit
<a name="..."> / id="...". An anchor #L<n> or #L<n>-L<m> into another file
must be within its lines.  Links with a scheme (https:, mailto:) are not
followed.  A page named in prose, as these docs cite each other
(docs/design.md, "Several daemons"; algorithm.md from within docs/), must
exist, and the quoted section must be one of its headings (its closing date
may be left out), a heading's words before a colon, or a paragraph's bold
lead.  The checker first checks itself on pages with known good and broken
links.  Prints one line per broken link and exits 1 if there is any.

usage: check_links.py --anchors PAGE  (the anchors GitHub gives PAGE)
"""

import os
import re
import sys
import tempfile
import unicodedata
import urllib.parse

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
# [text](target "title"): the text may hold [brackets] and run over lines.
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]\\]|\\.|\[[^\[\]]*\])*)\]"
                         r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                         r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF_ANY = re.compile(r"^ {0,3}\[([^\]]+)\]:[ \t]*(<[^>]*>|\S+)", re.M)
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_ID = re.compile(r"<[a-z][a-z0-9]*\s[^>]*\bid\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_HREF = re.compile(r"<a\s[^>]*\bhref\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
DATED = re.compile(r"\s*\(\d{4}-\d{2}-\d{2}\)\s*$")
BOLD_LEAD = re.compile(r"^\*\*([^*]+?)[.:]?\*\*")
LINE_ANCHOR = re.compile(r"^L(\d+)(?:-L(\d+))?$")
# A page named in prose, as these docs do: docs/design.md, "Several daemons".
PROSE_REF = re.compile(r"(?<![\w/.-])((?:docs/)?[a-z][a-z0-9_-]*\.md)(?:,?[ \n]+\"([^\"]+)\")?")


def strip_code_spans(text):
    """Replace inline code spans by spaces of the same length (links inside
    them are not links)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "`":
            j = i
            while j < len(text) and text[j] == "`":
                j += 1
            ticks = text[i:j]
            end = text.find(ticks, j)
            while end != -1 and end + len(ticks) < len(text) and text[end + len(ticks)] == "`":
                end = text.find(ticks, end + len(ticks) + 1)
            if end == -1:
                out.append(ticks)
                i = j
                continue
            out.append(" " * (end + len(ticks) - i))
            i = end + len(ticks)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def prose_lines(lines):
    """Yield (line number, line) outside fenced code blocks."""
    fence = None
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield n, line


def heading_text(raw):
    """The heading's text as GitHub renders it: code spans keep their content,
    links keep their text, emphasis markers and HTML tags go."""
    text = re.sub(r"`+([^`]*)`+", r"\1", raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*\*|__|\*|(?<!\w)_|_(?!\w))", "", text)
    return text


def slug(raw):
    """GitHub's anchor for a heading."""
    out = []
    for ch in heading_text(raw).strip().lower():
        cat = unicodedata.category(ch)
        if ch in "-_" or cat[0] in "LN" or cat == "Mn":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors_of(lines):
    """Every anchor a page has: heading slugs (with GitHub's -1, -2 suffixes
    for repeats) and explicit HTML names and ids."""
    found, seen = set(), {}
    prev = None
    for n, line in prose_lines(lines):
        m = HEADING.match(line)
        text = m.group(2) if m else None
        if text is None and prev is not None and prev.strip() and SETEXT.match(line) \
                and not HEADING.match(prev) and not prev.lstrip().startswith("|"):
            text = prev.strip()
        if text is not None:
            base = slug(text)
            count = seen.get(base, 0)
            found.add(base if count == 0 else "%s-%d" % (base, count))
            seen[base] = count + 1
        for rx in (HTML_ANCHOR, HTML_ID):
            for a in rx.findall(line):
                found.add(a)
        prev = line
    return found


def section_names(lines):
    """Slugs of the names by which prose may cite a page's sections: each
    heading whole or without a closing date ("(2026-12-01)"), a heading's
    words before a colon ("Launching" for "Launching: scape-run"), and a
    paragraph's bold lead ("**Mask deltas.**")."""
    names = set()
    for n, line in prose_lines(lines):
        m = HEADING.match(line) or BOLD_LEAD.match(line)
        if m:
            text = m.group(m.lastindex)
            undated = DATED.sub("", text)
            names.update(slug(t) for t in (text, undated, text.split(":", 1)[0]))
    return names


def prose_text(lines):
    """The page with fenced code blanked out and code spans replaced by
    spaces, so that a link or a reference may run over a line break; and a
    function from an offset in it to a line number."""
    kept = dict(prose_lines(lines))
    text = "\n".join(strip_code_spans(kept[n]) if n in kept else ""
                     for n in range(1, len(lines) + 1))
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]

    def line_of(offset):
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1
    return text, line_of


def links_of(lines):
    """(line number, target) of every link in the page's prose."""
    text, line_of = prose_text(lines)
    for m in INLINE_LINK.finditer(text):
        yield line_of(m.start(2)), m.group(2)
    for m in REF_DEF_ANY.finditer(text):
        yield line_of(m.start(2)), m.group(2)
    for m in HTML_HREF.finditer(text):
        yield line_of(m.start(1)), m.group(1)


class Checker:
    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.cache = {}
        self.anchor_cache = {}

    def lines(self, path):
        if path not in self.cache:
            with open(path, encoding="utf-8") as f:
                self.cache[path] = f.read().split("\n")
        return self.cache[path]

    def anchors(self, path):
        if path not in self.anchor_cache:
            self.anchor_cache[path] = anchors_of(self.lines(path))
        return self.anchor_cache[path]

    def check_anchor(self, path, anchor):
        """None when anchor exists in the file at path, else the problem."""
        if path.endswith(".md"):
            if anchor in self.anchors(path):
                return None
            return "no heading or anchor '#%s' in %s" % (anchor, self.rel(path))
        m = LINE_ANCHOR.match(anchor)
        if not m:
            return "anchor '#%s' into %s, which is not a .md page" % (anchor, self.rel(path))
        try:
            count = len("\n".join(self.lines(path)).splitlines())
        except UnicodeDecodeError:
            return "line anchor '#%s' into a binary file %s" % (anchor, self.rel(path))
        last = int(m.group(2) or m.group(1))
        if int(m.group(1)) < 1 or last > count:
            return "%s has %d lines, no #%s" % (self.rel(path), count, anchor)
        return None

    def rel(self, path):
        return os.path.relpath(path, self.root)

    def check_target(self, page, target):
        """None when the link resolves, else what is wrong with it."""
        target = target.strip()
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        if not target or SCHEME.match(target) or target.startswith("//"):
            return None
        path_part, _, anchor = target.partition("#")
        path_part = urllib.parse.unquote(path_part.split("?", 1)[0])
        anchor = urllib.parse.unquote(anchor)
        if not path_part:
            dest = page
        elif path_part.startswith("/"):
            dest = os.path.normpath(os.path.join(self.root, path_part.lstrip("/")))
        else:
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path_part))
        if not os.path.realpath(dest).startswith(self.root + os.sep) and \
                os.path.realpath(dest) != self.root:
            return "'%s' leaves the repository" % target
        if not os.path.exists(dest):
            return "'%s': %s does not exist" % (target, self.rel(dest))
        if path_part.endswith("/") and not os.path.isdir(dest):
            return "'%s': %s is not a directory" % (target, self.rel(dest))
        if anchor:
            if os.path.isdir(dest):
                return "'%s': an anchor into a directory" % target
            return self.check_anchor(dest, anchor)
        return None

    def check_prose_ref(self, page, name, section):
        """None when a page named in prose (docs/x.md from the root, x.md from
        the page's folder) exists and has the quoted section, if any."""
        base = self.root if name.startswith("docs/") else os.path.dirname(page)
        dest = os.path.join(base, name)
        if not os.path.isfile(dest):
            return "%s names %s, which does not exist" % (self.rel(page), self.rel(dest))
        if section and slug(section) not in section_names(self.lines(dest)):
            return "no section \"%s\" in %s" % (section, self.rel(dest))
        return None

    def check_page(self, page):
        problems = []
        for n, target in links_of(self.lines(page)):
            why = self.check_target(page, target)
            if why:
                problems.append("%s:%d: %s" % (self.rel(page), n, why))
        text, line_of = prose_text(self.lines(page))
        text = REF_DEF_ANY.sub(lambda m: " " * len(m.group(0)), text)
        text = INLINE_LINK.sub(lambda m: " " * len(m.group(0)), text)
        for m in PROSE_REF.finditer(text):
            section = " ".join(m.group(2).split()) if m.group(2) else None
            why = self.check_prose_ref(page, m.group(1), section)
            if why:
                problems.append("%s:%d: %s" % (self.rel(page), line_of(m.start()), why))
        return problems


def pages(root):
    found = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    found += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return found


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        sys.stderr.write("usage: check_links.py SOURCE_DIR (the repository root)\n")
        return 2
    if not self_test():
        return 1
    checker = Checker(argv[1])
    problems, links = [], 0
    for page in pages(checker.root):
        links += sum(1 for _ in links_of(checker.lines(page)))
        problems += checker.check_page(page)
    for p in problems:
        print(p)
    print("%d pages, %d links, %d broken" % (len(pages(checker.root)), links, len(problems)))
    if problems:
        print("fix each link above: point it to a file that exists, or to a heading of "
              "that page (GitHub's slug of it, shown by tests/docs/check_links.py --anchors PAGE)")
    return 1 if problems else 0


SELF_TEST_PAGE = """# Title: *the* `x_y` page (v2.0)
## Notes
## Notes
<a name="here"></a>
[ok](#title-the-x_y-page-v20) [ok](#notes-1) [ok](#here) [ok](other.md#sub-section)
[ok](../README.md) [ok](other.md "a title") [ok](./) [ok](../code.c#L2-L3)
[bad](#notes-2) [bad](#Notes) [bad](missing.md) [bad](other.md#nope) [bad](../code.c#L9)
[bad](other.md/) [bad](../../outside.md) `[not a link](missing.md)` other.md, "Sub"
other.md, "Sub-section" docs/nothing.md [a link over
two lines](other.md) [a broken one over
two lines](nowhere.md) other.md,
"Bold" and other.md, "Faint"
```
[not a link](missing.md)
```
[ref]: gone.md
"""
SELF_TEST_BROKEN = ["#notes-2", "#Notes", "missing.md", "#nope", "#L9", "other.md/",
                    "leaves", "\"Sub\"", "docs/nothing.md", "gone.md", "nowhere.md",
                    "\"Faint\""]


def self_test():
    """The checker itself, on pages with known good and broken links: each
    broken one reported once, nothing else."""
    with tempfile.TemporaryDirectory() as root:
        os.mkdir(os.path.join(root, "docs"))
        files = {"README.md": "", "code.c": "1\n2\n3\n", "docs/page.md": SELF_TEST_PAGE,
                 "docs/other.md": "### Sub-section\n**Bold.** text\n"}
        for name, text in files.items():
            with open(os.path.join(root, name), "w", encoding="utf-8") as f:
                f.write(text)
        checker = Checker(root)
        problems = checker.check_page(os.path.join(root, "docs", "page.md"))
    unmatched = [b for b in SELF_TEST_BROKEN if not any(b in p for p in problems)]
    if unmatched or len(problems) != len(SELF_TEST_BROKEN):
        print("self-test failed: reported %s; expected one line for each of %s" % (
            problems, SELF_TEST_BROKEN))
        return False
    return True


def print_anchors(path):
    checker = Checker(os.path.dirname(os.path.abspath(path)) or ".")
    for a in sorted(anchors_of(checker.lines(os.path.abspath(path)))):
        print("#" + a)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--anchors":
        sys.exit(print_anchors(sys.argv[2]))
    sys.exit(main(sys.argv))
