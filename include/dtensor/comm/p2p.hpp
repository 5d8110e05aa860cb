#pragma once
// Point-to-point: send, recv, isend, irecv and batch_isend_irecv, as in torch.distributed.
//
//   dtensor::send(t, /*dst=*/1, group);                       // blocks until the receiver took it
//   auto w = dtensor::irecv(buf, /*src=*/0, group);  w.wait();
//
//   // Pipeline 1F1B: exchange with both neighbours at once; never deadlocks.
//   std::vector<dtensor::P2POp> ops{
//       {dtensor::P2POp::isend, act, next, group}, {dtensor::P2POp::irecv, grad_in, next, group},
//       {dtensor::P2POp::isend, grad, prev, group}, {dtensor::P2POp::irecv, act_in, prev, group}};
//   for (auto& w : dtensor::batch_isend_irecv(ops)) w.wait();
//
// Peers are group ranks. Successive messages from a to b with the same tag are received in order; tags
// (0 <= tag < 2^23) keep independent streams apart. Point-to-point traffic never mixes with collectives.
// A send completes when the receiver posted the matching receive (rendezvous), so a blocking send to a
// rank that first does a blocking send to you deadlocks, as with NCCL: use isend/irecv or a batch.

#include "dtensor/comm/backend_call.hpp"

#include <memory>
#include <span>
#include <vector>

namespace dtensor {

/// One operation of batch_isend_irecv: `P2POp{P2POp::isend, tensor, peer, group, tag}`.
struct P2POp {
  enum Kind : std::uint8_t { isend, irecv };

  template <class T, int Rank>
  P2POp(Kind kind, const Tensor<T, Rank>& tensor, int peer, ProcessGroup group, int tag = 0)
      : kind(kind), peer(peer), tag(tag), group(std::move(group)) {
    buffer = detail::comm_buffer(tensor, this->group, kind == isend ? "isend" : "irecv", "");
    keep = detail::keep_alive(tensor);
  }

  Kind kind;
  int peer;
  int tag;
  ProcessGroup group;
  BufferRef buffer;           ///< the tensor's memory
  std::shared_ptr<void> keep; ///< the tensor, kept alive until the op completes
};

namespace detail {

inline Work p2p_one(P2PRequest::Kind kind, BufferRef buf, std::shared_ptr<void> keep, int peer,
                    const ProcessGroup& group, int tag, bool async) {
  const char* op = kind == P2PRequest::Kind::send ? (async ? "isend" : "send") : (async ? "irecv" : "recv");
  P2PRequest r{kind, buf, peer, tag};
  return launch(
      async, [&](const CommOptions& o) { return group.p2p(std::span(&r, 1), o, op); }, std::move(keep));
}

} // namespace detail

/// Sends `tensor` to group rank `dst`; returns when the receiver took it.
template <class T, int Rank>
void send(const Tensor<T, Rank>& tensor, int dst, const ProcessGroup& group, int tag = 0) {
  detail::p2p_one(P2PRequest::Kind::send, detail::comm_buffer(tensor, group, "send", ""), nullptr, dst, group,
                  tag, false);
}
/// Receives into `tensor` (sized like the message) from group rank `src`.
template <class T, int Rank>
void recv(const Tensor<T, Rank>& tensor, int src, const ProcessGroup& group, int tag = 0) {
  detail::p2p_one(P2PRequest::Kind::recv, detail::comm_buffer(tensor, group, "recv", ""), nullptr, src, group,
                  tag, false);
}
template <class T, int Rank>
Work isend(const Tensor<T, Rank>& tensor, int dst, const ProcessGroup& group, int tag = 0) {
  return detail::p2p_one(P2PRequest::Kind::send, detail::comm_buffer(tensor, group, "isend", ""),
                         detail::keep_alive(tensor), dst, group, tag, true);
}
template <class T, int Rank>
Work irecv(const Tensor<T, Rank>& tensor, int src, const ProcessGroup& group, int tag = 0) {
  return detail::p2p_one(P2PRequest::Kind::recv, detail::comm_buffer(tensor, group, "irecv", ""),
                         detail::keep_alive(tensor), src, group, tag, true);
}

/// Posts every op (receives and sends) before waiting on any, so exchanges in both directions never
/// deadlock. All ops must use the same group. Returns one Work per op (they complete together).
inline std::vector<Work> batch_isend_irecv(std::span<const P2POp> ops) {
  if (ops.empty()) {
    return {};
  }
  const ProcessGroup& group = ops[0].group;
  group.impl("batch_isend_irecv");
  std::vector<P2PRequest> reqs;
  reqs.reserve(ops.size());
  auto keep = std::make_shared<std::vector<std::shared_ptr<void>>>();
  for (const auto& op : ops) {
    DTENSOR_CHECK(op.group == group, detail::op_context(group, "batch_isend_irecv") +
                                         ": every op of a batch must use the same group; one uses " +
                                         op.group.to_string());
    reqs.push_back({op.kind == P2POp::isend ? P2PRequest::Kind::send : P2PRequest::Kind::recv, op.buffer,
                    op.peer, op.tag});
    keep->push_back(op.keep);
  }
  Work w = detail::launch(
      true, [&](const CommOptions& o) { return group.p2p(reqs, o, "batch_isend_irecv"); }, keep);
  return std::vector<Work>(ops.size(), w);
}
inline std::vector<Work> batch_isend_irecv(const std::vector<P2POp>& ops) {
  return batch_isend_irecv(std::span<const P2POp>(ops));
}

} // namespace dtensor
