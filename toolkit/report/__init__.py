"""The results store -> what people read: configuration rows (`rows`), a Markdown table (`markdown`), a
quality-vs-latency Pareto plot (`pareto`), a self-contained HTML page (`html`), and a recommendation within a
quality budget (`recommend`). Nothing here measures; every number comes from a stored result with its protocol."""
