"""A node's review-policy services: an admin of a project sets its review policy (`epibus policy set`), which
the node records on the stream beside the enrolment records; members read it (`epibus policy show`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.nats_errors import JS_TIMEOUT_S
from bus.enrolment.service_rules import ServiceGuard, current_asker, policy_rule, policy_show_rule
from bus.identity.signing import AgentKey
from bus.intake.batch_context import EnrolmentLog
from bus.model.auth import ReviewPolicy
from bus.model.authority import policy_event
from bus.model.requests import PolicyReply, PolicySetRequest, PolicyShowRequest
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import retrying_unavailable, send_one
from bus.services.responder import Responder, serve
from bus.subjects import ADMIN_QUEUE, POLICY_SET, POLICY_SHOW


class ReviewPolicies:
    """The POLICY_SET and POLICY_SHOW services of one node, answered by one node of the admin queue group."""

    def __init__(
        self, js: JetStreamContext, signer: AgentKey, records: EnrolmentLog, guard: ServiceGuard, *, node_name: str
    ) -> None:
        self.js = js
        self.signer = signer  # the node's event identity (signing.node_event_key)
        self.records = records
        self.guard = guard
        self.node_name = node_name

    async def serve(self, nc: NatsClient) -> dict[str, Responder[Any, Any]]:
        name, queue = self.node_name, ADMIN_QUEUE
        set_rule, show_rule = self.guard.authorizer(policy_rule, always=True), self.guard.authorizer(policy_show_rule)
        return {
            POLICY_SET: await serve(
                nc, POLICY_SET, PolicySetRequest, PolicyReply, self.set_policy, node=name, queue=queue,
                authorize=set_rule,
            ),
            POLICY_SHOW: await serve(
                nc, POLICY_SHOW, PolicyShowRequest, PolicyReply, self.show_policy, node=name, queue=queue,
                authorize=show_rule,
            ),
        }  # fmt: skip

    async def set_policy(self, request: PolicySetRequest) -> PolicyReply:
        """Record the project's review policy on the stream (signed by this node), where every path reads it.
        Raises Unavailable once the bounded retries are spent."""
        asker = current_asker()
        policy = ReviewPolicy(
            project=request.project,
            human_review_impact=request.human_review_impact,
            mode=request.mode,
            set_by=asker.agent_id if asker is not None else self.node_name,
            set_at=datetime.now(UTC),
        )
        row = OutboxRow.of(policy_event(self.signer, policy, session_id=self.node_name))
        async for attempt in retrying_unavailable():
            with attempt:
                await send_one(self.js, row, timeout_s=JS_TIMEOUT_S)
        return PolicyReply(node=self.node_name, project=policy.project, policy=policy.model_dump(mode="json"))

    async def show_policy(self, request: PolicyShowRequest) -> PolicyReply:
        """The project's newest review policy in the stream's records (null: none was ever set)."""
        policy = (await self.records.read()).policy(request.project)
        dumped = policy.model_dump(mode="json") if policy is not None else None
        return PolicyReply(node=self.node_name, project=request.project, policy=dumped)
