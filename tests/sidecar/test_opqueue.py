"""The bounded op queue every ingest can use (kvlookup.sidecar.opqueue)."""

from kvlookup.sidecar.opqueue import OpQueue


def test_ops_fold_per_holder_and_keep_arrival_order():
    q = OpQueue()
    q.add("a", 0, "cpu", [("1", "a"), ("2", "a")])
    q.add("a", 0, "cpu", [("1", "e")])  # same holder: folded into its batch, last op wins
    q.add("b", 0, "cpu", [("1", "a")])
    q.add("a", 0, "cpu", [("3", "a")])  # another holder came between: a new batch
    assert [(b.instance_id, b.ops) for b in q.batches] == [
        ("a", {"1": "e", "2": "a"}), ("b", {"1": "a"}), ("a", {"3": "a"})]
    assert q.queued_ops == 4


def test_take_splits_at_the_budget_and_put_back_restores_the_order():
    q = OpQueue()
    q.add("a", 0, "cpu", [(str(i), "a") for i in range(5)])
    q.add("b", 1, "disk", [("9", "e")])
    taken = q.take(3)
    assert [(b.instance_id, list(b.ops)) for b in taken] == [("a", ["0", "1", "2"])]
    assert (q.queued_ops, [list(b.ops) for b in q.batches]) == (3, [["3", "4"], ["9"]])
    q.put_back(taken)
    assert (q.queued_ops, [list(b.ops) for b in q.batches]) == (6, [["0", "1", "2"], ["3", "4"], ["9"]])
    assert [len(b.ops) for b in q.take(None)] == [3, 2, 1] and not q and q.lag_s() == 0.0


def test_drop_takes_one_workers_batches_of_one_location_or_all():
    q = OpQueue()
    q.add("a", 0, "cpu", [("1", "a")])
    q.add("a", 0, "disk", [("2", "a")])
    q.add("a", 1, "cpu", [("3", "a")])
    assert [b.location for b in q.drop("a", 0, "disk")] == ["disk"]
    assert [b.location for b in q.drop("a", 0)] == ["cpu"]
    assert ([(b.worker_id, b.ops) for b in q.batches], q.queued_ops) == ([(1, {"3": "a"})], 1)
