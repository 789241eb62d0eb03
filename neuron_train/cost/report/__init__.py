"""report, comparing: `rows` (one typed row per measured, estimated, imported or unsupported figure),
`compare` (the rows read, priced, grouped by workload, compared with a baseline), `references`
(Neuron's published tables), `render` (tables, CSV, Markdown, HTML), `charts` (PNG), `folder` (the
report folder, checked first, published whole).
"""
