"""Coordination through etcd: a client (`etcd`) and a local process (`etcd_process`), the
cluster map as pure data (`membership`), load per slot and the planning of moves
(`balance`), and a cluster on this machine (`local_cluster`)."""
