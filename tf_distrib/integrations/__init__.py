"""Integrations with distributed engines that start the workers for you.

Each one is an optional extra, imported only when used:
`tf_distrib.integrations.ray` needs `pip install "tf_distrib[ray]"`.
"""
