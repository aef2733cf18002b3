"""Speculative decoding's kernels: sgl-kernel-npu's draft tree and greedy verification, and the
triton kernels of sglang's ``speculative/spec_utils.py``, program by program."""
from __future__ import annotations



def build_tree_kernel_efficient(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                draft_token_num, tree_mask_mode):
    """sgl-kernel-npu's EAGLE draft tree, as sgl-kernel's CUDA ``build_tree_efficient`` computes it
    (csrc/speculative/eagle_utils.cu; the NPU op takes the same arguments for the same result),
    thread by thread: per request, the token tree's mask rows (FULL_MASK: each draft token's row
    over the prefix and the draft tokens; QLEN_ONLY: over the draft tokens only), each draft
    token's position (seq_len + its depth), and the retrieval lists (index, first child, next
    sibling).  QLEN_ONLY_BITPACKING raises by name."""
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError("simnpu: build_tree_kernel_efficient with tree_mask_mode %d" % tree_mask_mode)
    n = draft_token_num
    sel = selected_index.reshape(-1).tolist()
    parents = parent_list.reshape(-1).tolist()
    seq_lens = [int(x) for x in verified_seq_len.tolist()]
    width = topk * (depth - 1) + 1
    nt, ns = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    for bid in range(parent_list.shape[0]):
        seq_len = seq_lens[bid]
        seq_tree_idx = n * n * bid + sum(seq_lens[:bid]) * n
        for tid in range(n):
            if tree_mask_mode == 0:
                token_tree_idx = seq_tree_idx + (seq_len + n) * tid + seq_len + 1
            else:
                token_tree_idx = n * n * bid + n * tid + 1
            tree_mask[token_tree_idx - 1] = True
            tree_mask[token_tree_idx:token_tree_idx + n - 1] = False
            if tid == 0:
                positions[bid * n] = seq_len
                for i in range(n - 1, 0, -1):
                    retrive_index[bid, i] = bid * n + i
                    parent_tb_idx = sel[bid * (n - 1) + i - 1] // topk
                    parent_position = 0
                    if parent_tb_idx > 0:
                        parent_token_idx = parents[bid * width + parent_tb_idx]
                        while parent_position < n:
                            if sel[bid * (n - 1) + parent_position] == parent_token_idx:
                                parent_position += 1
                                break
                            parent_position += 1
                    if parent_position == n:
                        continue  # the kernel's "invalid eagle tree" case: the token is skipped
                    slot = bid * n + parent_position
                    if int(nt[slot]) == -1:
                        nt[slot] = i
                    else:
                        ns[bid * n + i] = int(nt[slot])
                        nt[slot] = i
                retrive_index[bid, 0] = bid * n
            else:
                cur, position = tid - 1, 0
                while True:
                    position += 1
                    tree_mask[token_tree_idx + cur] = True
                    parent_tb_idx = sel[bid * (n - 1) + cur] // topk
                    if parent_tb_idx == 0:
                        break
                    token_idx = parents[bid * width + parent_tb_idx]
                    cur = next((c for c in range(n - 1) if sel[bid * (n - 1) + c] == token_idx), n - 1)
                positions[bid * n + tid] = position + seq_len


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict):
    """sgl_kernel_npu.sample.verify_tree_greedy (a triton kernel and its launcher; sglang's
    eagle_utils.verify_tree_greedy_func calls it on NPU), program by program as
    ``verify_tree_greedy_kernel`` computes it: per request, walk the draft chain in order (the
    kernel reads candidates i = 1.. against the target's prediction at i - 1, not the sibling
    lists), accepting while draft token == target token; the accepted slots into accept_index
    (its row of num_draft_tokens), their count, and the target's tokens into predicts."""
    bs, n = candidates.shape
    cand, ridx, target = candidates.tolist(), retrive_index.tolist(), target_predict.tolist()
    flat_accept = accept_index.view(-1)
    for req in range(bs):
        last = ridx[req][0]
        flat_accept[req * n] = last
        accepted, rejected = 0, False
        for i in range(1, n):
            if rejected:
                continue
            if cand[req][i] == target[req][i - 1]:
                draft_idx = ridx[req][i]
                predicts[last] = target[req][i - 1]
                accepted += 1
                flat_accept[req * n + accepted] = draft_idx
                last = draft_idx
            else:
                rejected = True
        accept_token_num[req] = accepted
        predicts[last] = target[req][last - n * req]


# -- EAGLE / NextN speculative decoding's triton kernels (sglang.srt.speculative.spec_utils), each
# program of the kernel's grid in turn, as the kernel computes it (masked loads and stores become
# the slices they cover)

def _create_extend_after_decode_spec_info(verified_id, seq_lens, accept_lens, positions,
                                          new_verified_id, bs_upper):
    """spec_utils.create_extend_after_decode_spec_info: per request, the positions of its accepted
    tokens (seq_len - accept_len ... seq_len - 1, packed after the earlier requests') and its last
    accepted token as the new verified id."""
    import torch

    cum = 0
    for pid in range(seq_lens.shape[0]):
        seq, acc = int(seq_lens[pid]), int(accept_lens[pid])
        positions[cum:cum + acc] = torch.arange(seq - acc, seq)
        new_verified_id[pid] = verified_id[cum + acc - 1]
        cum += acc


def _assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                              out_cache_loc, pool_len, bs_upper):
    """spec_utils.assign_req_to_token_pool: request pid's slots start..end of its req_to_token row
    from out_cache_loc, packed after the earlier requests' (end - start each)."""
    out = 0
    for pid in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[pid]), int(end_offset[pid])
        row = req_to_token[int(req_pool_indices[pid])]
        row[start:end] = out_cache_loc[out:out + end - start].to(row.dtype)
        out += end - start


def _assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, extend_lens,
                             num_new_pages_per_topk, out_cache_loc, source_cache_loc,
                             target_cache_loc, last_page_lens_cumsum, duplicate_cache_len, pool_len,
                             topk, speculative_num_steps, page_size, bs_upper, iter_upper):
    """spec_utils.assign_draft_cache_locs, its part 1 (page size 1 or top-k 1, the case sglang
    launches it for here): each request's topk * steps draft slots into its req_to_token row after
    its seq_len.  The paged top-k > 1 duplication (parts 2 and 3) raises by name."""
    if not (page_size == 1 or topk == 1):
        raise NotImplementedError("simnpu: assign_draft_cache_locs with page_size %d and topk %d "
                                  "(the last-page duplication) has no stand-in" % (page_size, topk))
    copy_len = topk * speculative_num_steps
    for pid in range(req_pool_indices.shape[0]):
        row = req_to_token[int(req_pool_indices[pid])]
        kv_start = int(seq_lens[pid])
        row[kv_start:kv_start + copy_len] = out_cache_loc[pid * copy_len:(pid + 1) * copy_len].to(row.dtype)


def _align_evict_mask_to_page_size(seq_lens, evict_mask, page_size, num_draft_tokens, BLOCK_SIZE):
    """spec_utils.align_evict_mask_to_page_size: keep (un-evict) the draft slots of the page the
    accepted tokens end in.  ``evict_mask`` is [bs * num_draft_tokens]."""
    for bid in range(seq_lens.shape[0]):
        row = evict_mask[bid * num_draft_tokens:(bid + 1) * num_draft_tokens]
        num_false = num_draft_tokens - int(row.sum())
        seq_len = int(seq_lens[bid])
        start = (seq_len + num_false - 1) // page_size * page_size - seq_len
        for i in range(max(start, 0), min(start + page_size, num_draft_tokens)):
            row[i] = False


def _get_target_cache_loc(tgt_cache_loc, to_free_slots, accept_length, to_free_num_slots,
                          out_cache_loc, num_verify_tokens, num_verify_tokens_upper, bs_upper):
    """spec_utils.get_target_cache_loc: per request, its first accept_length + 1 verify slots into
    tgt_cache_loc and its last to_free_num_slots into to_free_slots, each packed after the earlier
    requests'."""
    for bid in range(accept_length.shape[0]):
        row = out_cache_loc[bid * num_verify_tokens:(bid + 1) * num_verify_tokens]
        start = int(accept_length[:bid].sum()) + bid
        n = int(accept_length[bid]) + 1
        tgt_cache_loc[start:start + n] = row[:n]
        free_n = int(to_free_num_slots[bid])
        free_start = int(to_free_num_slots[:bid].sum())
        to_free_slots[free_start:free_start + free_n] = row[num_verify_tokens - free_n:]


def _filter_finished_cache_loc(out_cache_loc, tgt_cache_loc, accept_length, accept_length_filter,
                               bs_upper, num_verify_tokens_upper):
    """spec_utils.filter_finished_cache_loc_kernel: the kept slots of the unfinished requests
    (accept_length_filter each, 0 for a finished one) packed into out_cache_loc."""
    for bid in range(accept_length.shape[0]):
        old = int(accept_length[:bid].sum()) + bid
        new = int(accept_length_filter[:bid].sum())
        n = int(accept_length_filter[bid])
        out_cache_loc[new:new + n] = tgt_cache_loc[old:old + n]
