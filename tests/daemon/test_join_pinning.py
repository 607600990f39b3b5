"""What a volunteer takes from a run and what it never takes (docs/security.md, "Who is trusted with what";
docs/security.md, "Exhaust a daemon"): local paths stay its own, and
closed runs admit only keys with a coordinator-signed admission."""

import time

import pytest

from bootstrap.admissions import Admissions, issue_token, read_allowlist
from hetnode.config import replace
from hetnode.daemon.swarm import local_config
from hetnode.errors import ConfigError, HetnodeError, WireError
from hetnode.net.identity import ephemeral_identity
from hetnode.net.signing import sign_text
from hetnode.protocol.membership import Membership
from hetnode.service.datadir import DataDir
from hetnode.wire.admission import Admission, admission_body
from hetnode.wire.manifest import PROTOCOL_VERSION, Manifest, manifest_from_envelope


def test_a_manifest_never_sets_local_paths(tiny_config):
    hostile = replace(tiny_config, "data", data_dir="/etc", source="dir:/root/.ssh")
    with pytest.raises(ConfigError, match="--data-source"):
        local_config(hostile, None, "~/.cache/hetnode")
    mine = local_config(hostile, "dir:/home/me/corpus", "/tmp/cache")
    assert (mine.data.source, mine.data.data_dir) == ("dir:/home/me/corpus", "/tmp/cache")
    bundled = local_config(replace(tiny_config, "data", data_dir="/etc"), None, "/tmp/cache")
    assert (bundled.data.source, bundled.data.data_dir) == ("wiki", "/tmp/cache")
    assert bundled.model == tiny_config.model and bundled.outer == tiny_config.outer


@pytest.fixture
def coordinator():
    return ephemeral_identity()


def closed_manifest(config, coordinator, mode="tokens"):
    key = coordinator.private_key.get_public_key().to_bytes().decode()
    envelope = Manifest(PROTOCOL_VERSION, "run-1", config, 1.0, (), mode, key).envelope()
    return manifest_from_envelope(envelope)  # as a volunteer reads it


class _NoNode:
    def set_probe_policy(self, policy):  # pragma: no cover - follow() is not run here
        pass


def test_tokens_admit_one_key_each_and_members_check_the_admission(tiny_config, coordinator, tmp_path):
    manifest = closed_manifest(tiny_config, coordinator)
    with DataDir(tmp_path / "boot") as data_dir:
        admissions = Admissions("tokens", coordinator, "run-1", data_dir)
        alice, mallory = ephemeral_identity(), ephemeral_identity()
        token = issue_token(coordinator, "alice", days=1)
        with pytest.raises(WireError, match="--token"):
            admissions.grant(alice.peer_id, "")
        granted = admissions.grant(alice.peer_id, token)
        assert admissions.grant(alice.peer_id, token)  # the same key again (a restart): fine
        with pytest.raises(WireError, match="already used"):
            admissions.grant(mallory.peer_id, token)
        forged = issue_token(ephemeral_identity(), "mallory", days=1)  # not the coordinator's signature
        with pytest.raises(WireError, match="signature"):
            admissions.grant(mallory.peer_id, forged)
    # the decisions survive a restart
    with DataDir(tmp_path / "boot") as data_dir:
        again = Admissions("tokens", coordinator, "run-1", data_dir)
        with pytest.raises(WireError, match="already used"):
            again.grant(mallory.peer_id, token)

    membership = Membership(_NoNode(), tiny_config, manifest, coordinator.peer_id)
    assert membership.admitted(alice.peer_id, {"admission": granted})
    assert not membership.admitted(mallory.peer_id, {"admission": granted})  # copied from alice's record
    assert not membership.admitted(mallory.peer_id, {"admission": None})
    expired = sign_text(
        coordinator, "admission", admission_body(Admission("run-1", mallory.peer_id, "m", 1.0))
    )
    assert not membership.admitted(mallory.peer_id, {"admission": expired})
    other_run = Admission("run-2", mallory.peer_id, "m", time.time() + 60)
    assert not membership.admitted(
        mallory.peer_id, {"admission": sign_text(coordinator, "admission", admission_body(other_run))}
    )
    assert membership.admitted(coordinator.peer_id, {})  # the coordinator needs none


def test_an_allowlist_admits_only_its_keys(tiny_config, coordinator, tmp_path):
    alice, bob = ephemeral_identity(), ephemeral_identity()
    listed = tmp_path / "allow.txt"
    listed.write_text(f"# volunteers\n{alice.peer_id}  # alice\n\n")
    with DataDir(tmp_path / "boot") as data_dir:
        admissions = Admissions("allowlist", coordinator, "run-1", data_dir, read_allowlist(listed))
        assert admissions.grant(alice.peer_id, "")
        with pytest.raises(WireError, match="allowlist"):
            admissions.grant(bob.peer_id, "")
    listed.write_text("not-a-peer-id\n")
    with pytest.raises(HetnodeError, match="not a peer id"):
        read_allowlist(listed)


def test_a_manifest_whose_key_is_not_the_pinned_coordinators_is_refused(tiny_config, coordinator):
    manifest = closed_manifest(tiny_config, coordinator)
    with pytest.raises(HetnodeError, match="not the key"):
        Membership(_NoNode(), tiny_config, manifest, ephemeral_identity().peer_id)
