"""The model weights the service serves: the pinned revision, staged and verified by the weights step."""

import pytest


@pytest.mark.deployed
def test_served_weights(target):
    """The unit's --model-path (and draft path, when it speculates) is the pinned revision's staged directory,
    and the weights step's record says it verified that revision there."""
    target.check("served_weights")
