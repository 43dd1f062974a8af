"""tools/build_debian_corpus.py's text extraction, without Debian packages: HTML to text, the
removal of lines a package's pages share, files reached through linked directories read once,
dictionaries cut into documents."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import build_debian_corpus as B  # noqa: E402


def test_html_text_keeps_visible_text_only():
    page = ("<html><head><style>p {color: red}</style><script>var x = 1;</script></head>"
            "<body><h1>Title</h1><p>First  paragraph\n of text.</p><p>Second &amp; last.</p>"
            "</body></html>")
    assert B.html_text(page) == "Title\nFirst paragraph\nof text.\nSecond & last."


def test_without_boilerplate_drops_the_lines_most_pages_share():
    menu = "Home | Index | Search"
    docs = [(f"p{i}", f"{menu}\nPage {i} says something of its own.\n{menu}")
            for i in range(30)]
    docs.append(("p30", menu))  # a page of menu only
    out = B.without_boilerplate(docs)
    assert len(out) == 30 and ("p30", menu) not in out
    assert out[7] == ("p7", "Page 7 says something of its own.")
    # the control: at most min_docs pages share the line, so it stays
    few = B.without_boilerplate(docs[:20])
    assert few[0] == docs[0]


def test_files_reads_a_file_reached_through_a_linked_directory_once(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").write_text("alpha")
    (tmp_path / "real" / "empty.txt").write_text("  \n")
    os.symlink(tmp_path / "real", tmp_path / "alias")
    got = list(B._files(str(tmp_path), "**/*.txt", "pkg"))
    assert got == [("pkg/alias/a.txt", "alpha")]  # one of the two names; the empty file skipped
    assert len(list(B._files(str(tmp_path / "real"), "*.txt", "pkg"))) == 1


def test_chunks_cut_a_dictionary_into_documents_of_whole_entries():
    entries = [f"word{i}\n  " + "definition " * 300 for i in range(20)]
    docs = list(B._chunks("\n\n".join(entries), "dict"))
    assert [d for d, _ in docs] == [f"dict/{n:06d}" for n in range(len(docs))]
    assert 1 < len(docs) < 20
    joined = "\n\n".join(t for _, t in docs)
    assert joined == "\n\n".join(e.strip() for e in entries)  # nothing lost, nothing split
