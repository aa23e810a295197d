"""MoE routers behind one interface.

Public entry points: :func:`available_routers`, :func:`build_router`, :func:`register_router`,
:class:`Router`, :class:`RouterConfig`, :class:`RouterOutput`, :class:`RoutingConstraint`.
"""

from routers.base import Router, RouterConfig, RouterOutput, RoutingConstraint, RoutingKind
from routers.metrics import routing_metrics, simpson_index
from routers.registry import available_routers, build_router, register_router, router_class, router_options
from routers.schedule import begin_step, end_step, routers_in

__all__ = [
    "Router",
    "RouterConfig",
    "RouterOutput",
    "RoutingConstraint",
    "RoutingKind",
    "available_routers",
    "build_router",
    "register_router",
    "router_class",
    "router_options",
    "routing_metrics",
    "simpson_index",
    "begin_step",
    "end_step",
    "routers_in",
]
