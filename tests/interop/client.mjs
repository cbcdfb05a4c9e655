// An epibus agent written in plain Node.js (no epibus code): it reads every event of its project from the
// node's stream, verifies each signature with plain ed25519 over the documented bytes, and publishes one signed
// event of its own. Input: EPIBUS_NATS_URL, EPIBUS_SEED (the agent's nkey seed), EPIBUS_AGENT, EPIBUS_PROJECT.
// Output: one JSON line, {"verified", "legacy", "failed", "published": {"event_id", "subject", "seq"}}.
import { createHash, createPublicKey, randomBytes, verify } from "node:crypto";
import { connect, createInbox, headers, nkeyAuthenticator } from "nats";
import { fromPublic, fromSeed } from "@nats-io/nkeys";

const STREAM = "EPI";
const SIGNATURE_HEADER = "Epibus-Event-Signature";
const KEY_HEADER = "Epibus-Event-Key";
const DOMAIN = "epibus-event-v2\n";
const ED25519_SPKI_PREFIX = Buffer.from("302a300506032b6570032100", "hex");
const BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

function need(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set; the pytest interop test sets it`);
  return value;
}

// An nkey user public key ('U…') is base32 of [prefix byte, 32-byte ed25519 key, crc16]; nkeys checks the crc.
function ed25519Key(publicKey) {
  fromPublic(publicKey); // throws on a malformed key or a bad checksum
  let bits = 0;
  let value = 0;
  const out = [];
  for (const ch of publicKey) {
    value = (value << 5) | BASE32.indexOf(ch);
    bits += 5;
    if (bits >= 8) {
      out.push((value >>> (bits - 8)) & 0xff);
      bits -= 8;
    }
  }
  const raw = Buffer.from(out.slice(1, 33));
  return createPublicKey({ key: Buffer.concat([ED25519_SPKI_PREFIX, raw]), format: "der", type: "spki" });
}

// What an event signature covers: the domain, the subject, a newline, the body bytes exactly as received.
function signedBytes(subject, body) {
  return Buffer.concat([Buffer.from(DOMAIN + subject + "\n", "utf8"), Buffer.from(body)]);
}

// The key the registry binds to an agent, asked of a node: an agent may not read the registry itself (it names
// the whole fleet). `agents` asks for their current records; an `after_seq` past the stream's end asks for no
// enrolment history. An agent outside every project this one shares is not in `current`: not verifiable here.
const registered = new Map();
async function registeredKey(nc, pair, me, agentId) {
  if (!registered.has(agentId)) {
    const answer = await ask(nc, pair, me, "epibus.enrolments.view", {
      after_seq: Number.MAX_SAFE_INTEGER,
      agents: [agentId],
    });
    const record = answer.current.find((e) => e.agent_id === agentId);
    registered.set(agentId, record ? record.public_key : null);
  }
  return registered.get(agentId);
}

async function check(nc, pair, me, msg) {
  const signature = msg.headers?.get(SIGNATURE_HEADER) ?? "";
  const publicKey = msg.headers?.get(KEY_HEADER) ?? "";
  if (!signature && !publicKey) return "legacy"; // schema_version 1: the signature is inside the body
  const event = JSON.parse(Buffer.from(msg.data).toString("utf8"));
  if (event.schema_version !== 2 || event.actor?.public_key !== publicKey) return "failed";
  const ok = verify(null, signedBytes(msg.subject, msg.data), ed25519Key(publicKey), Buffer.from(signature, "base64url"));
  if (!ok) return "failed";
  return (await registeredKey(nc, pair, me, event.actor.agent_id)) === publicKey ? "verified" : "failed";
}

function uuid7() {
  const b = randomBytes(16);
  b.writeUIntBE(Date.now(), 0, 6);
  b[6] = (b[6] & 0x0f) | 0x70;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = b.toString("hex");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

// A signed request to the nodes: the signature covers subject, reply subject, time and the body's sha256.
async function ask(nc, pair, agent, subject, request) {
  const body = Buffer.from(JSON.stringify(request), "utf8");
  const reply = createInbox(`_INBOX_${pair.getPublicKey()}`);
  const signedAt = new Date().toISOString();
  const digest = createHash("sha256").update(body).digest("hex");
  const payload = Buffer.from([subject, reply, signedAt, digest].join("\n"), "utf8");
  const h = headers();
  h.set("Epibus-Signer", agent);
  h.set("Epibus-Signer-Key", pair.getPublicKey());
  h.set("Epibus-Signed-At", signedAt);
  h.set("Epibus-Signature", Buffer.from(pair.sign(payload)).toString("base64url"));
  const msg = await nc.request(subject, body, { timeout: 10_000, headers: h, noMux: true, reply });
  const answer = JSON.parse(Buffer.from(msg.data).toString("utf8"));
  if (answer.error) throw new Error(`${subject}: node ${answer.node} refused: ${answer.error}`);
  return answer;
}

async function readProject(nc, pair, agent, project) {
  // An agent creates no consumer: it asks a node, which names the consumer for the agent's key and filters it
  // to the project; the broker then lets the agent read, inspect and delete that one name.
  const opened = await ask(nc, pair, agent, "epibus.consumer.open", {
    owner_key: pair.getPublicKey(),
    stream: STREAM,
    filter_subject: `epi.${project}.>`,
    start_seq: 1,
    idle_s: 30,
  });
  if (!opened.name) throw new Error(`no consumer slot free: ${opened.open.join(", ")}`);
  const name = opened.name;
  const consumer = await nc.jetstream().consumers.get(STREAM, name);
  const counts = { verified: 0, legacy: 0, failed: 0 };
  let left = (await consumer.info()).num_pending;
  while (left > 0) {
    const batch = await consumer.fetch({ max_messages: left, expires: 5_000 });
    let got = 0;
    for await (const msg of batch) {
      counts[await check(nc, pair, agent, msg)] += 1;
      got += 1;
    }
    if (got === 0) throw new Error(`the consumer stopped with ${left} message(s) still pending`);
    left -= got;
  }
  await consumer.delete(); // frees the slot at once (idle ones close by themselves)
  return counts;
}

async function publishOne(nc, pair, agent, project) {
  const eventId = uuid7();
  const event = {
    event_id: eventId,
    schema_version: 2,
    project,
    kind: "finding",
    artifact_id: eventId,
    actor: { agent_id: agent, public_key: pair.getPublicKey() },
    session_id: "node-interop",
    recorded_at: new Date().toISOString(),
    body: { text: "written by a Node.js agent", impact: 0.4, confidence: 0.6, subject: "interop" },
  };
  const subject = `epi.${project}.finding.${eventId}`;
  const body = Buffer.from(JSON.stringify(event), "utf8"); // not canonical JSON: the bytes sent are what is signed
  const h = headers();
  h.set("Nats-Msg-Id", eventId);
  h.set(SIGNATURE_HEADER, Buffer.from(pair.sign(signedBytes(subject, body))).toString("base64url"));
  h.set(KEY_HEADER, pair.getPublicKey());
  const ack = await nc.jetstream().publish(subject, body, { headers: h, timeout: 10_000 });
  return { event_id: eventId, subject, seq: ack.seq };
}

async function main() {
  const seed = need("EPIBUS_SEED");
  const pair = fromSeed(new TextEncoder().encode(seed));
  const nc = await connect({
    servers: need("EPIBUS_NATS_URL"),
    authenticator: nkeyAuthenticator(new TextEncoder().encode(seed)),
    inboxPrefix: `_INBOX_${pair.getPublicKey()}`, // the broker lets an agent receive only on its own inboxes
    timeout: 10_000,
    reconnect: false,
  });
  try {
    const project = need("EPIBUS_PROJECT");
    const counts = await readProject(nc, pair, need("EPIBUS_AGENT"), project);
    const published = await publishOne(nc, pair, need("EPIBUS_AGENT"), project);
    process.stdout.write(JSON.stringify({ ...counts, published }) + "\n");
  } finally {
    await nc.close();
  }
}

await main();
