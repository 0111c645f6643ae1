"""Plain-text tables for the commands' reports (`refbert check`, `verify`, the precision study)."""


def text_table(head, body):
    """Columns left-aligned to their widest cell, two spaces apart, a dashed rule under the header."""
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, body)])
