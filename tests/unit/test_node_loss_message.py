"""What the driver says when Ray reports a node of the run dead (no Ray here: the node table is
given; tests/e2e/test_node_loss.py stops a real raylet)."""
from pathlib import Path

from rlrecipes.cluster import LostNode, lost_nodes, unanswering_nodes
from rlrecipes.recipe import load_recipe
from rlrecipes.workflow.supervise import WorkerPlacement, node_loss_message, resume_command

A, B, C = "a" * 56, "b" * 56, "c" * 56


def table(**alive):
    return [{"NodeID": n, "Alive": up, "NodeManagerAddress": f"10.0.0.{i}",
             "DeathReasonMessage": "" if up else "received SIGTERM"}
            for i, (n, up) in enumerate(alive.items())]


def test_lost_nodes_from_the_node_table():
    assert lost_nodes([A, B, A], table(**{A: True, B: True})) == []
    assert lost_nodes([A, B, A], table(**{A: True, B: False})) == [LostNode(B, "10.0.0.1", "received SIGTERM")]
    # a node the GCS no longer lists is lost too
    assert lost_nodes([C], table(**{A: True})) == [LostNode(C, "address unknown", "")]


def test_message_names_the_node_the_ranks_the_checkpoint_and_the_resume(tmp_path: Path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000004")
    where = WorkerPlacement(run, [A, B, A, B], "rlrecipes run r --resume " + str(run))
    msg = node_loss_message(where, [LostNode(B, "10.0.0.2", "received SIGTERM")], (17, "update"))
    assert msg.startswith("lost a node of the Ray cluster during stage 'update' of step 17: ")
    assert f"node {B} (10.0.0.2) [received SIGTERM], which held worker ranks 1, 3" in msg
    assert str(run / "checkpoints" / "step_000004") in msg and f"--resume {run}" in msg
    two = node_loss_message(where, [LostNode(A, "10.0.0.1"), LostNode(B, "10.0.0.2")])
    assert two.startswith("lost 2 nodes of the Ray cluster: ") and "ranks 0, 2" in two and "ranks 1, 3" in two


def test_message_without_a_checkpoint(tmp_path: Path):
    where = WorkerPlacement(tmp_path, [A], "rlrecipes run r --resume x")
    msg = node_loss_message(where, [LostNode(A, "10.0.0.1")])
    assert "which held worker rank 0" in msg and "No checkpoint had been written yet" in msg and "--resume" not in msg


def test_resume_command_matches_how_the_run_reached_ray(tmp_path: Path):
    r = load_recipe("qwen25_7b", smoke=True)
    run = tmp_path / "my run"
    assert resume_command(r, run, True, None) == f"rlrecipes run qwen25_7b --resume '{run}' --smoke"
    assert resume_command(r, run, False, "10.0.0.1:6379") == \
        f"rlrecipes run qwen25_7b --resume '{run}' --address 10.0.0.1:6379"


def test_a_raylet_port_that_refuses_counts_as_lost():
    import socket

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        t = [{"NodeID": A, "Alive": True, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening.getsockname()[1]},
             {"NodeID": B, "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": closed.getsockname()[1]},
             {"NodeID": C, "Alive": False, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1}]
        lost = unanswering_nodes([A, B, C], t)
    assert [n.node_id for n in lost] == [B]  # C is the GCS's to report (lost_nodes)
    assert "does not answer" in lost[0].reason and str(t[1]["NodeManagerPort"]) in lost[0].reason
