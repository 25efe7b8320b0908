"""One self-contained HTML page: the table, the Pareto PNG inlined as base64, the protocols. No script, no font,
no stylesheet from the network: it opens the same offline as online."""

import base64
import html
from pathlib import Path

from toolkit.report.markdown import COLUMNS, cells, protocol_marks

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px}td{text-align:right}td:first-child{text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #ddd}li{margin:4px 0}"""


def render_html(rows, png: str | Path | None, title: str = "specquant benchmarks", note: str = "") -> str:
    qmarks, smarks = protocol_marks(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r, qmarks, smarks)) + "</tr>"
                   for r in rows)
    image = ""
    if png:
        data = base64.b64encode(Path(png).read_bytes()).decode()
        image = f'<h2>Quality vs latency</h2><img alt="Pareto plot" src="data:image/png;base64,{data}">'
    protocols = "".join(f"<li><b>[{m}]</b> {html.escape(t)}</li>" for t, m in (*qmarks.items(), *smarks.items()))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{html.escape(note)}</p><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"{image}<h2>Protocols</h2><ul>{protocols}</ul></body></html>\n")
