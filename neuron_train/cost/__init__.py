"""Price-performance: the benchmark (`bench`, writes one versioned result file), the instance
catalog and prices (`catalog`), Neuron's published figures (`references`), and the report that
merges results into tables and charts (`report`, `rows`, `charts`).

May import: `neuron_train.common`, and `neuron_train.training` to run the loop it measures.
"""
