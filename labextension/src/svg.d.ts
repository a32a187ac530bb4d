// SVG files are bundled as strings by @jupyterlab/builder's webpack config.
declare module '*.svg' {
  const value: string;
  export default value;
}
