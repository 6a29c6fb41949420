// Typeset the formulas on a page with the KaTeX served from the site itself (vendor/katex/).
//
// On the chapter pages, pymdownx.arithmatex (generic mode) wraps each formula in an element of class
// "arithmatex", as \( ... \) inline or \[ ... \] on a line of its own; only those elements are rendered,
// so a "$" in code or prose is never taken for maths. On the notebook pages (mkdocs-jupyter), the
// markdown cells keep the notebook's own $ ... $ and $$ ... $$; auto-render skips code and pre there.
// material's document$ emits on the first load and again after every instant navigation. A formula
// KaTeX cannot parse is reported on the console (auto-render's default), which the browser test
// counts as a failure.
document$.subscribe(function () {
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: true,
    });
  });
  document.querySelectorAll(".jupyter-wrapper .jp-RenderedMarkdown").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [
        { left: "$$", right: "$$", display: true },
        { left: "$", right: "$", display: false },
      ],
      throwOnError: true,
    });
  });
});
