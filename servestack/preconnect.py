"""Validate the inventory the moment pyinfra has loaded it, before any host connects."""

from servestack.settings import validate_inventory
from servestack.targets import refuse_local_targets


def validate_targets(state) -> None:
    """Validate settings of every host in the run's limit; refuse local or placeholder targets."""
    hosts = [host for host in state.inventory if state.is_host_in_limit(host)]
    validate_inventory(hosts)
    refuse_local_targets(hosts)


def validate_after_inventory_load(state) -> None:
    """Hook `validate_targets` onto `state.init`, which pyinfra's CLI calls right before connecting.

    pyinfra 3.10 has no hook between loading the inventory and connecting (its callback list is
    created inside `State.init`), so the bound method is wrapped on this one state object.
    """
    original_init = state.init

    def init_then_validate(inventory, config, **kwargs):
        original_init(inventory, config, **kwargs)
        validate_targets(state)

    state.init = init_then_validate
