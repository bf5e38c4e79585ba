"""A replicated cluster of headwater nodes coordinated through etcd (docs/cluster.md).

etcd holds what must be agreed on: which nodes are alive (each holds a lease and a key
under it), which streams exist, and per partition its replicas, leader, leader epoch
and in-sync replica set, changed only by compare-and-set transactions. One node, elected
through etcd, is the controller: it places new partitions and moves the leadership of
a dead node's partitions to an in-sync follower. Headwater itself never runs a
consensus protocol of its own.
"""
