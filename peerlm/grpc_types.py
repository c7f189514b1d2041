"""Type aliases for grpc's generic stub classes (grpc-stubs makes them generic for mypy;
at run time they are plain classes and cannot be subscripted)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
    ServicerContext = grpc.aio.ServicerContext[Any, Any]
    RpcMethodHandler = grpc.RpcMethodHandler[Any, Any]
else:
    ServerInterceptor = grpc.aio.ServerInterceptor
    ServicerContext = grpc.aio.ServicerContext
    RpcMethodHandler = grpc.RpcMethodHandler

__all__ = ["RpcMethodHandler", "ServerInterceptor", "ServicerContext"]
