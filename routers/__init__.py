"""MoE routers behind one interface (``docs/routers.md``); the public entry points are ``__all__``."""

from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics, simpson_index
from routers.registry import available_routers, build_router, register_router, router_class
from routers.schedule import begin_step, end_step, routers_in

__all__ = [
    "Router", "RouterConfig", "RouterOutput", "RoutingConstraint", "RoutingKind",  # the interface
    "available_routers", "build_router", "register_router", "router_class",  # the registry
    "routing_metrics", "simpson_index",  # shared metrics
    "begin_step", "end_step", "routers_in",  # the step schedules
]
