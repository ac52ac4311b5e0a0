"""The page's words and look: the teaching text (kept as data, apart from the wiring) and the CSS of the HTML that
``ui.render`` writes. Colours follow ``visualize.palette``: blue is the accepted path, orange the bonus token."""

INTRO = """\
# ♻️ Token Recycling, live
Speculative decoding with no draft model ([arXiv 2408.08696](https://arxiv.org/abs/2408.08696)). Every forward pass
ranks the whole vocabulary; Token Recycling keeps the top *k* candidates after each token in an **adjacency matrix**
instead of throwing them away. Each step it grows a **draft tree** from that matrix, starting at the last token,
checks the whole tree in **one forward pass**, keeps the longest path the model agrees with plus the model's own next
token (the **bonus token**), and writes the new candidates back into the matrix. The answer is exactly plain
decoding's, greedy or sampled with the same seed; only the number of forward passes shrinks."""

RACE_INTRO = """\
The same prompt and settings (below) through plain decoding and the methods you pick (by default Prompt Lookup
Decoding, Token Recycling and its best extension beyond the paper). Each is **measured alone**, one after another, so
that none shares the CPU with another, and each method that keeps a matrix starts from its own copy of yours; then the
runs are **replayed side by side at the speed each was measured at**. Every method must give the same answer as plain
decoding, greedy or sampled (a temperature above 0: the same seed gives every method the same sample at every
position; every token's numbers are computed alike alone, in a tree or in a prompt chunk): a difference (only where
the status line says this CPU could not make the kernels batch-invariant) is shown, not hidden."""

TREE_PLACEHOLDER = ("Each step's draft tree appears here: the root (the last token), the drafts the matrix "
                    "proposed, the path the model accepted, and the bonus token it added itself.")
MATRIX_PLACEHOLDER = ("The adjacency-matrix rows each step rewrote appear here: before (where the drafts came from) "
                      "and after (the model's new top-k candidates at each tree node).")
BUDGET_PLACEHOLDER = ("With the auto tree, Token Recycling picks each step's tree size itself: the expected tokens per "
                      "second of every size, from its own measured steps, appear here.")
RACE_PLACEHOLDER = "Tokens produced against time, one line per method, as measured, appear here."

CSS = """
.tr-clamped { font-size: 13px; color: #B35900; margin-top: 4px; }
#intro p { font-size: 14px; }
.tr-answer { white-space: pre-wrap; line-height: 1.7; font-size: 15px; min-height: 6em; padding: 8px 10px;
             border: 1px solid var(--border-color-primary); border-radius: 6px; }
.tr-empty { color: var(--body-text-color-subdued); }
.tr-draft { background: rgba(0, 114, 178, 0.16); border-bottom: 2px solid #0072B2; }
.tr-bonus { background: rgba(230, 159, 0, 0.22); border-bottom: 2px solid #E69F00; }
.tr-step:not(.tr-multi) > .tr-bonus { background: none; border-bottom: none; }
.tr-current { outline: 2px dashed #444; outline-offset: 1px; border-radius: 2px; }
.tr-legend { font-size: 13px; margin: 0 0 6px; color: var(--body-text-color-subdued); }
.tr-legend span { padding: 0 3px; color: var(--body-text-color); }
.tr-counters { display: grid; grid-template-columns: repeat(4, 1fr); gap: 10px; }
.tr-stat { border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 4px 12px;
           display: flex; align-items: baseline; gap: 8px; }
.tr-stat b { font-size: 22px; font-variant-numeric: tabular-nums; }
.tr-stat span { font-size: 13px; color: var(--body-text-color-subdued); }
.tr-status { font-size: 13px; margin-top: 6px; min-height: 1.2em; color: var(--body-text-color-subdued); }
.tr-lanes { display: grid; grid-template-columns: repeat(3, 1fr); gap: 12px; }
.tr-lane h4 { margin: 0 0 6px; padding-left: 8px; border-left: 5px solid #000; }
.tr-lane-pld h4 { border-left-color: #D55E00; }
.tr-lane-tr h4 { border-left-color: #0072B2; }
.tr-lane .tr-answer { min-height: 12em; font-size: 14px; }
.tr-lane-foot { font-size: 13px; margin-top: 4px; color: var(--body-text-color-subdued); }
.tr-table { border-collapse: collapse; width: 100%; font-size: 14px; margin: 8px 0; border: none !important; }
.tr-table th, .tr-table td { border: none !important; border-bottom: 1px solid var(--border-color-primary) !important;
                             padding: 4px 10px; text-align: left; }
.tr-table tr { border: none !important; }
.tr-table th { font-weight: 600; }
.tr-same { color: #009E73; font-weight: 600; }
.tr-differs { color: #D55E00; font-weight: 600; }
.tr-diff { font-size: 14px; margin: 6px 0; white-space: pre-wrap; }
.tr-diff del { background: rgba(0, 0, 0, 0.08); } .tr-diff ins { background: rgba(213, 94, 0, 0.18); }
"""


# a page narrower than this (a phone) gets the figures' compact layout: the one viewport check, for every tab
NARROW_PX = 700
PROJECTION_PLACEHOLDER = ("What the same accepted tokens would give on other hardware (a laptop CPU, a T4, an A100, "
                          "an H100), from a stated model of a step's cost, appears here.")
STEPS_PLACEHOLDER = "Each decoding step's time and the tokens it added appear here, beside plain decoding's."
# The tree to watch where the fitted tree is empty (no tree pays on this machine), and what the page then says
WATCH_TREE = "small"
CANNOT_PAY = ("On this machine drafting does not pay: the auto tree is fitted to what a forward pass costs here, and "
              "verifying even one draft token costs more than it saves, so this run drafted nothing: it was plain "
              "decoding. To watch Token Recycling draft anyway (slower than plain decoding here), run the "
              f"{WATCH_TREE} tree.")

# Run once when the page loads: a number box that gets a value outside its control's range (typed, or pasted) is set
# to the nearest allowed value and says so under the box, in the API's own terms ("Temperature (0 = greedy) is at
# most 2; set to 2."), until a value in range is entered. It listens before the page's own handler (capture), so it
# reads the value as typed and hands on the allowed one. Then it says whether the window is narrow (a phone).
CLAMP_NOTES_JS = """() => {
  const note = (input, text) => {
    const block = input.closest('.block') || input.parentElement;
    let el = block.querySelector(':scope > .tr-clamped');
    if (!text) { if (el) el.remove(); return; }
    if (!el) {
      el = document.createElement('div'); el.className = 'tr-clamped'; el.setAttribute('role', 'status');
      block.appendChild(el);
    }
    el.textContent = text;
  };
  const check = (input) => {
    if (!(input instanceof HTMLInputElement) || input.type !== 'number') return;
    const label = (input.getAttribute('aria-label') || '').replace(/^number input for /, '') ||
      (input.closest('.block')?.querySelector('[data-testid="block-info"]')?.textContent || 'This value').trim();
    const value = parseFloat(input.value), min = parseFloat(input.min), max = parseFloat(input.max);
    if (Number.isNaN(value)) note(input, `${label}: type a number.`);
    else if (!Number.isNaN(max) && value > max) {
      note(input, `${label} is at most ${max}; set to ${max}.`); input.value = input.dataset.clamped = String(max);
    } else if (!Number.isNaN(min) && value < min) {
      note(input, `${label} is at least ${min}; set to ${min}.`); input.value = input.dataset.clamped = String(min);
    } else if (input.value !== input.dataset.clamped) {  // a value in range, not the one set above: the note goes
      note(input, ''); delete input.dataset.clamped;
    }
  };
  // before the page's own handlers (capture), on every way a typed value is committed: Enter, leaving the box, change
  document.addEventListener('keydown', (event) => { if (event.key === 'Enter') check(event.target); }, true);
  document.addEventListener('focusout', (event) => check(event.target), true);
  document.addEventListener('change', (event) => check(event.target), true);
  // A message (an error of Live, a replay or a model load; the race's status) is brought into view as it appears:
  // Run scrolls the answer into view before the request, which left a message above it out of sight
  const bring = () => document.querySelectorAll('.tr-notice, #race-status, #model-status, #race-model-status')
    .forEach((el) => {
      const text = el.textContent.trim();
      if (!text || el.dataset.trShown === text) return;
      el.dataset.trShown = text;
      if (!el.matches('.tr-notice') && !/Not run|Not loaded/.test(text)) return;
      const r = el.getBoundingClientRect();
      if (r.top < 0 || r.bottom > window.innerHeight) el.scrollIntoView({behavior: 'instant', block: 'center'});
    });
  new MutationObserver(bring).observe(document.body, {childList: true, subtree: true, characterData: true});
  return window.innerWidth < %d;
}""" % NARROW_PX
