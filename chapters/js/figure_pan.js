// On a phone a figure is kept wide enough for its text to be read (css/narrow.css, hooks/narrow.py) and
// pans sideways inside its frame. Whether a frame does pan depends on the screen, so it is told here: a
// frame whose figure is wider than it gets the class "pans", and "more-left" / "more-right" while there
// is more of the figure that way; css/narrow.css draws the hint from these.
document$.subscribe(function () {
  var frames = Array.prototype.slice.call(document.querySelectorAll(".md-typeset a.glightbox"))
    .filter(function (frame) { return frame.querySelector("img[style*='--min-legible']"); });
  function mark(frame) {
    var pans = frame.scrollWidth > frame.clientWidth + 1;
    frame.classList.toggle("pans", pans);
    frame.classList.toggle("more-left", pans && frame.scrollLeft > 1);
    frame.classList.toggle("more-right", pans && frame.scrollLeft + frame.clientWidth < frame.scrollWidth - 1);
  }
  function markAll() { frames.forEach(mark); }
  frames.forEach(function (frame) {
    var img = frame.querySelector("img");
    if (!img.complete) img.addEventListener("load", function () { mark(frame); });
    frame.addEventListener("scroll", function () { mark(frame); }, { passive: true });
  });
  window.addEventListener("resize", markAll);
  markAll();
});
