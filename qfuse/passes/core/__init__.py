"""The pass machinery every family uses: the manager, the fused linear and its emission, the report, transactions, graph utilities."""
