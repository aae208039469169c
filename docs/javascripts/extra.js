// miniddp site: small adjustments to Material and the vendored mermaid.
// Loaded after mermaid.min.js and before the page is ready, that is before Material
// renders any diagram (it calls mermaid.initialize, then mermaid.render per diagram).
(function () {
  "use strict";

  if (typeof mermaid !== "undefined" && !(mermaid instanceof Element)) {
    // Mermaid 11 names its markers "<diagram id>-arrowhead" etc., which Material's
    // theme CSS ("#arrowhead path") misses: sequence-diagram arrows stayed dark grey,
    // invisible on the slate palette. Colour every arrowhead like the lines it ends.
    const arrowsCSS = [
      "marker[id$='-arrowhead'] path, marker[id$='-filled-head'] path,",
      "marker[id$='TopArrowHead'] path, marker[id$='BottomArrowHead'] path",
      "{fill: var(--md-mermaid-sequence-message-line-color) !important;",
      " stroke: var(--md-mermaid-sequence-message-line-color) !important}",
      "marker[id$='-crosshead'] path, marker[id*='stick'] path",
      "{stroke: var(--md-mermaid-sequence-message-line-color) !important}",
      "marker[id$='-sequencenumber'] circle {fill: var(--md-mermaid-sequence-number-bg-color) !important}",
      "marker path.arrowMarkerPath, marker .arrowheadPath",
      "{fill: var(--md-mermaid-edge-color) !important; stroke: var(--md-mermaid-edge-color) !important}",
    ].join("\n");
    const initialize = mermaid.initialize.bind(mermaid);
    mermaid.initialize = function (config) {
      config = Object.assign({}, config);
      config.themeCSS = (config.themeCSS || "") + arrowsCSS;
      return initialize(config);
    };

    // Mermaid draws a diagram at width 100% with max-width its natural width, so a
    // wide one shrinks to the column and its text becomes unreadable. Keep at least
    // MIN_SCALE of the natural size; the .mermaid box scrolls (stylesheets/extra.css).
    const MIN_SCALE = 0.75;
    const render = mermaid.render.bind(mermaid);
    mermaid.render = async function (...args) {
      const result = await render(...args);
      const svg = result.svg.replace(/^(<svg[^>]*?style=")max-width: ([\d.]+)px;/, (all, head, width) =>
        `${head}max-width: ${width}px; min-width: ${Math.round(width * MIN_SCALE)}px;`);
      return Object.assign({}, result, {svg});
    };
  }

  function adjust() {
    // Code blocks wrap: a wrapped line continues 4 columns right of its own indentation.
    document.querySelectorAll(".md-typeset pre > code > span[id^='__span-']").forEach(function (line) {
      const indent = /^ */.exec(line.textContent)[0].length;
      if (indent) line.style.setProperty("--md-indent", indent + "ch");
    });
    // Tables: flags and file names in code never break inside (`--flag`, not `-` `-flag`).
    // A short code span stays whole; a long one breaks only between its words, and
    // inside a word only when the word alone is too long (a long test id).
    document.querySelectorAll(".md-typeset td code, .md-typeset th code").forEach(function (code) {
      const text = code.textContent;
      if (text.length <= 32) { code.classList.add("md-nowrap"); return; }
      if (code.children.length) return;
      code.textContent = "";
      text.split(/(\s+)/).forEach(function (word) {
        if (!word || /^\s+$/.test(word) || word.length > 32) { code.append(word); return; }
        const span = document.createElement("span");
        span.className = "md-nowrap";
        span.textContent = word;
        code.append(span);
      });
    });
  }

  if (typeof document$ !== "undefined") document$.subscribe(adjust);
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", adjust);
  else adjust();
})();
